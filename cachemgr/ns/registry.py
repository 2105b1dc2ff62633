"""The namespace registry: namespace dirs and manifests on disk, rows and bindings in the DB.

The disk is the truth for what exists (a dir under <root>/ns/ with its manifest); the DB says
which instance is bound to which namespace, and keeps a durable copy of each binding on disk
(bindings.py) to be rebuilt from. Page counts come from a directory scan, because the daemon's
index may not be running when `init`, `ls` or `purge` look.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from cachemgr.errors import CachemgrError, ConfigError, StateError, UnsafePathError
from cachemgr.formats import EngineName, engine_of, format_for
from cachemgr.fs.dirscan import Usage, scan_usage
from cachemgr.fs.safe import make_dir, on_other_mount, open_dir
from cachemgr.layout import NS_DIR, NS_ID_RE, Layout, check_ns_id
from cachemgr.layout import check_instance as check_instance  # nsreg.check_instance callers
from cachemgr.ns import bindings
from cachemgr.ns.manifest import (
    Manifest,
    identity_kv_cache_dtype,
    identity_model,
    identity_page_size,
    identity_record,
    read_manifest,
    write_manifest,
)
from cachemgr.ns.quarantine import is_denied, unreadable_problem
from cachemgr.state import pages_sql
from cachemgr.state import registry_sql as sql
from cachemgr.state.status import bindings_by_namespace
from cachemgr.state.store import Store

log = logging.getLogger(__name__)
_MANIFEST_RE = re.compile(r"([0-9a-f]{16})\.json")
NsState = Literal[
    "bound", "unbound", "no-manifest", "missing-dir", "unsafe", "bad-manifest", "unreadable"
]


def ns_entry_kind(layout: Layout, ns_id: str) -> Literal["dir", "absent"]:
    """Whether ns/<id> is a real directory or absent; UnsafePathError for anything else (a
    mount point too: another filesystem's or dir's files are not the engine's to lose)."""
    check_ns_id(ns_id)
    with open_dir(layout.root, "ns") as fd:
        try:
            st = os.stat(ns_id, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return "absent"
        if stat.S_ISDIR(st.st_mode) and on_other_mount(fd, ns_id):
            raise UnsafePathError(
                f"{layout.ns_dir(ns_id)} is a mount point (another filesystem or a bind "
                "mount): on another mount than the root; cachemgr does not enter it"
            )
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{layout.ns_dir(ns_id)} is a symlink; cachemgr does not follow it")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{layout.ns_dir(ns_id)} is not a directory")
    return "dir"


def make_ns_dir(layout: Layout, ns_id: str) -> bool:
    """Create ns/<id>/ if absent (True if created); a symlink or file in its place is refused."""
    check_ns_id(ns_id)
    with open_dir(layout.root, NS_DIR) as fd:
        try:
            make_dir(ns_id, fd)
            return True
        except FileExistsError:
            pass
        except OSError as e:
            raise ConfigError(f"cannot create {layout.ns_dir(ns_id)}: {e.strerror}") from e
    ns_entry_kind(layout, ns_id)
    return False


def on_disk(layout: Layout) -> tuple[set[str], set[str]]:
    """(ids with a dir or other entry under ns/, ids with a manifest); other names are ignored."""
    dirs: set[str] = set()
    manifests: set[str] = set()
    try:
        with open_dir(layout.root, "ns") as fd, os.scandir(fd) as it:
            for entry in it:
                if NS_ID_RE.fullmatch(entry.name):
                    dirs.add(entry.name)
                elif m := _MANIFEST_RE.fullmatch(entry.name):
                    manifests.add(m.group(1))
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise
    return dirs, manifests


def damaged(layout: Layout) -> dict[str, tuple[NsState, str]]:
    """Namespaces under ns/ that cachemgr leaves alone: id → (state, why).

    `unsafe`: ns/<id> is a symlink, a FIFO, a file; `bad-manifest`: ns/<id>.json is not a
    regular file, is larger than the manifest size limit, or does not validate; `unreadable`:
    this user may not read ns/<id>.json. Reads each manifest (a few KiB, never a FIFO), so it
    costs one small read per namespace.
    """
    entries, manifests = on_disk(layout)
    out: dict[str, tuple[NsState, str]] = {}
    for ns_id in sorted(manifests):
        try:
            read_manifest(layout, ns_id)
        except StateError as e:
            out[ns_id] = manifest_damage(e)
    for ns_id in sorted(entries):
        try:
            ns_entry_kind(layout, ns_id)
        except UnsafePathError as e:
            out[ns_id] = ("unsafe", str(e))
    return out


def unreadable_dir(layout: Layout, ns_id: str) -> str | None:
    """Why this user may not list ns/<id> (another user's 0700, chmod 000), as `ls` and
    `status` say it; None when it can be listed or is not there."""
    try:
        _listable(layout, ns_id)
    except OSError as e:
        if not is_denied(e):
            raise
        return unreadable_problem(e)
    return None


def _listable(layout: Layout, ns_id: str) -> bool:
    """Whether the namespace dir is there and can be listed and an entry stat'ed, as a scan
    would; the OSError a scan would raise if it cannot."""
    try:
        with open_dir(layout.root, f"ns/{ns_id}") as fd, os.scandir(fd) as entries:
            for entry in entries:
                with contextlib.suppress(FileNotFoundError):  # deleted since the listing
                    os.stat(entry.name, dir_fd=fd, follow_symlinks=False)
                break
    except FileNotFoundError:
        return False
    return True


def manifest_damage(error: CachemgrError) -> tuple[NsState, str]:
    """The state and reason of a namespace whose manifest could not be read: `unreadable`
    when the kernel refused this user (mode bits, another owner: the listing is not whole,
    docs/exit-codes.md), else `bad-manifest` (its content or kind is wrong)."""
    cause = error.__cause__
    if isinstance(cause, OSError) and is_denied(cause):
        return "unreadable", f"manifest {unreadable_problem(cause)}"
    return "bad-manifest", str(error)


def ensure_namespace(
    layout: Layout, store: Store, *, ns_id: str, digest: str, identity: dict[str, Any], now: float
) -> bool:
    """Create ns/<id>/ and its manifest, or refresh its last-active time; True if created.

    A manifest naming another digest under this id is refused (a 64-bit id collision, or a
    hand edit); an unreadable one is replaced, since the id says which identity it must hold.
    """
    if not digest.startswith(check_ns_id(ns_id)):
        raise ConfigError(f"namespace id {ns_id} is not a prefix of digest {digest}")
    try:
        old = read_manifest(layout, ns_id)
    except StateError as e:
        log.warning("replacing unreadable manifest", extra={"ns": ns_id, "error": str(e)})
        old = None
    if old is not None and old.digest != digest:
        raise StateError(
            f"{layout.manifest(ns_id)} holds identity {old.digest}, not {digest}; "
            "move it aside if you edited it"
        )
    created = make_ns_dir(layout, ns_id)
    manifest = old.touched(now) if old else Manifest(ns_id, digest, identity, now, now)
    write_manifest(layout, manifest)
    with store.transaction():
        register(store, manifest)
    return created


# --- the DB side ---


def adopt_from_disk(layout: Layout, store: Store, *, write_files: bool = True) -> list[str]:
    """Register namespaces whose manifest is on disk but which the DB does not know (a lost
    or rebuilt DB), their times from the manifest, and bind the instances the DB does not know
    from their binding files, in one transaction; then bring those files in line with the DB
    (unless `write_files` is off: read-only commands, working on a copy, write nothing).

    Returns the ids registered. An unreadable manifest is left for `ls`/doctor to report.
    """
    _, manifests = on_disk(layout)
    known = sql.namespace_ids(store.conn)
    found = []
    for ns_id in sorted(manifests - known):
        try:
            manifest = read_manifest(layout, ns_id)
        except (StateError, UnsafePathError):
            continue
        if manifest is not None:
            found.append(manifest)
    files, problems = bindings.read_bindings(layout)
    late = bindings.behind(layout, store, files)
    if found or late:
        with store.transaction():
            for manifest in found:
                register(store, manifest)
            restored = bindings.restore(layout, store, late)
        log.info(
            "registered namespaces found on disk",
            extra={"ns": [m.ns_id for m in found], "bound": restored},
        )
    if problems:
        log.warning("binding files left alone", extra={"problems": problems})
    if write_files:
        bindings.write_down(layout, store, files)
    return [m.ns_id for m in found]


def register(store: Store, manifest: Manifest) -> None:
    """Insert or refresh the namespace's row from its manifest (state active)."""
    sql.upsert_namespace(
        store.conn,
        (
            manifest.ns_id,
            manifest.digest,
            json.dumps(manifest.identity, sort_keys=True),
            manifest.created_at,
            manifest.last_active_at,
        ),
    )


def bind(layout: Layout, store: Store, instance: str, ns_id: str, now: float) -> str | None:
    """Bind `instance` to `ns_id` (registered first); returns the namespace it was bound to.

    Call inside a transaction: the binding file is written before the commit, so a failed
    write (a full disk) leaves the DB as it was."""
    check_instance(instance)
    previous = binding_of(store, instance)
    sql.upsert_binding(store.conn, instance, ns_id, now)
    bindings.write_binding(layout, bindings.Binding(instance, ns_id, now))
    return previous


def binding_of(store: Store, instance: str) -> str | None:
    return sql.binding_of(store.conn, instance)


def instances_of(store: Store, ns_id: str) -> tuple[str, ...]:
    """The instances bound to `ns_id`, sorted."""
    return sql.instances_of(store.conn, ns_id)


def mark_purged(store: Store, ns_id: str) -> None:
    """An unbound namespace was purged: keep its row (history), forget its page index."""
    sql.mark_namespace_purged(store.conn, ns_id)
    pages_sql.delete_namespace_pages(store.conn, ns_id)


def identity_json(store: Store, ns_id: str) -> str | None:
    return sql.identity_json(store.conn, ns_id)


# --- listing ---


@dataclass(frozen=True)
class NamespaceInfo:
    """One namespace as `ls` shows it: raw numbers, no formatting."""

    ns_id: str
    state: NsState
    instances: tuple[str, ...]
    engine: EngineName
    model: str | None
    kv_cache_dtype: str | None
    page_size: int | None
    # None: not counted (its dir could not be read, or is not a real dir), never a 0 shown
    # as if it were one
    pages: int | None
    bytes: int | None
    temps: int | None
    created_at: float | None
    last_active_at: float | None
    problem: str | None = None
    # Where engine, model, KV dtype and page size come from: its manifest, or, when that
    # cannot be read, the state DB's copy of it (registered by init); None: neither.
    identity_from: Literal["manifest", "registry"] | None = None


def list_namespaces(
    layout: Layout,
    store: Store,
    *,
    counted: bool = True,
    known: Mapping[str, Usage] | None = None,
) -> list[NamespaceInfo]:
    """Every namespace on disk or bound in the DB, sorted by id. Their pages and bytes are
    `known`'s (a running daemon's index) or counted on disk; without `counted`, the others
    are 0 (their states alone: no dir of millions of pages is listed)."""
    dirs, manifests = on_disk(layout)
    bound = bindings_by_namespace(store.conn)
    registered = {r["id"]: r["identity_json"] for r in sql.registry_rows(store.conn)}
    ids = sorted(dirs | manifests | set(bound))
    known = known or {}
    return [
        describe(
            layout,
            ns,
            bound.get(ns, ()),
            counted=counted,
            known=known.get(ns),
            registered=identity_record(registered.get(ns)),
        )
        for ns in ids
    ]


def describe(
    layout: Layout,
    ns_id: str,
    instances: tuple[str, ...],
    *,
    counted: bool = True,
    known: Usage | None = None,
    registered: dict[str, Any] | None = None,
) -> NamespaceInfo:
    """Scan one namespace (or, given its usage or not `counted`, see that its dir can be
    listed, as a scan would); damage (a symlink, a bad manifest) becomes its state, not an
    error. Its identity is its manifest's, else the `registered` copy of it (the DB's)."""
    problem: str | None = None
    manifest: Manifest | None = None
    usage: Usage | None = None
    uncounted = False
    state: NsState = "bound" if instances else "unbound"
    try:
        manifest = read_manifest(layout, ns_id)
    except CachemgrError as e:
        state, problem = manifest_damage(e)
    identity = manifest.identity if manifest else registered or None
    identity_from: Literal["manifest", "registry"] | None = (
        "manifest" if manifest else "registry" if identity else None
    )
    try:
        if ns_entry_kind(layout, ns_id) == "dir":
            if counted and known is None:
                usage = scan_usage(layout, f"ns/{ns_id}", format_for(identity))
            elif _listable(layout, ns_id):
                usage = known or Usage()
    except UnsafePathError as e:  # cachemgr does not enter it: its pages are not known
        state, problem, uncounted = "unsafe", str(e), True
    except OSError as e:  # another user's dir (0700, chmod 000): its pages are not known
        if not is_denied(e):
            raise
        state, problem, uncounted = "unreadable", unreadable_problem(e), True
    if state in ("bound", "unbound"):
        if usage is None:
            state = "missing-dir"
        elif manifest is None:
            state = "no-manifest"
    usage = usage or Usage()
    return NamespaceInfo(
        ns_id=ns_id,
        state=state,
        instances=instances,
        engine=engine_of(identity),
        model=identity_model(identity) if identity else None,
        kv_cache_dtype=identity_kv_cache_dtype(identity) if identity else None,
        page_size=identity_page_size(identity) if identity else None,
        pages=None if uncounted else usage.pages,
        bytes=None if uncounted else usage.bytes,
        temps=None if uncounted else usage.temps,
        created_at=manifest.created_at if manifest else None,
        last_active_at=manifest.last_active_at if manifest else None,
        problem=problem,
        identity_from=identity_from,
    )
