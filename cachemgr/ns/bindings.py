"""Instance bindings on disk: <root>/ns/<instance>.bind names the namespace a server uses.

Every reader asks the state DB's `bindings` table; these files are its durable copy beside the
manifests. The DB can be lost, found corrupt and moved aside, or deleted under the daemon, and
is then rebuilt from disk: without the files every namespace would come back unbound, and GC
would drop namespaces that servers still use.

- `namespaces.bind` writes the file inside the DB transaction, before its commit: a failed
  write leaves the DB as it was.
- While the DB has an instance's binding, the DB wins: a file that is absent (a root bound by
  an older cachemgr) or names another namespace (an init that died before its commit) is
  rewritten from it, under the root lock, so a concurrent init is never undone.
- An instance the DB does not know is bound from its file (`restore`), in the transaction
  that registers the namespaces found on disk: GC never sees them unbound in between.
- cachemgr never unbinds an instance (it only moves it), so it never deletes these files; they
  are never namespaces (a namespace is 16 hex digits, these end in .bind), and GC, purge, ls
  and doctor only ever look at namespace names.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

from cachemgr.errors import (
    CachemgrError,
    ConfigError,
    ConflictError,
    StateError,
    UnsafePathError,
)
from cachemgr.fs.locks import root_lock
from cachemgr.fs.safe import open_dir, read_regular, write_atomic_at
from cachemgr.layout import BIND_SUFFIX, INSTANCE_RE, NS_DIR, NS_ID_RE, Layout
from cachemgr.ns.manifest import timestamp
from cachemgr.state import registry_sql
from cachemgr.state.store import Store

log = logging.getLogger(__name__)
BIND_VERSION = 1
BIND_MAX_BYTES = 4096  # a real one is ~100 bytes
REPAIR_LOCK_WAIT = 1.0  # s; a busy root lock (an init binding right now) leaves it to next time


@dataclass(frozen=True)
class Binding:
    """What ns/<instance>.bind holds."""

    instance: str
    ns_id: str
    bound_at: float

    def to_bytes(self) -> bytes:
        data = {"version": BIND_VERSION, "instance": self.instance, "ns_id": self.ns_id,
                "bound_at": self.bound_at}  # fmt: skip
        return (json.dumps(data, sort_keys=True) + "\n").encode()


def write_binding(layout: Layout, binding: Binding) -> None:
    """Write ns/<instance>.bind atomically; a symlink planted there is replaced, not followed."""
    path = layout.binding(binding.instance)
    try:
        with open_dir(layout.root, NS_DIR) as fd:
            write_atomic_at(fd, path.name, binding.to_bytes())
    except OSError as e:
        raise ConfigError(f"cannot write binding {path}: {e.strerror or e}") from e


def read_bindings(layout: Layout) -> tuple[dict[str, Binding], list[str]]:
    """(instance → its binding file, problems): a file that is not a regular one, too large,
    or not a valid binding is a problem, not a binding."""
    found: dict[str, Binding] = {}
    problems: list[str] = []
    try:
        with open_dir(layout.root, NS_DIR) as fd:
            names = [n for n in os.listdir(fd) if n.endswith(BIND_SUFFIX)]
            for name in sorted(names):
                instance = name.removesuffix(BIND_SUFFIX)
                if not INSTANCE_RE.fullmatch(instance):
                    continue  # not a name cachemgr writes
                try:
                    raw = read_regular(fd, name, BIND_MAX_BYTES)
                    found[instance] = parse_binding(raw, instance)
                except FileNotFoundError:
                    continue
                except (UnsafePathError, StateError) as e:
                    problems.append(f"{layout.binding(instance)}: {e}")
    except FileNotFoundError:
        pass
    return found, problems


def parse_binding(raw: bytes, instance: str) -> Binding:
    """Validate a binding file's bytes, strictly; StateError saying what is wrong."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise StateError(f"not JSON: {e}") from e
    if not isinstance(data, dict) or data.get("version") != BIND_VERSION:
        raise StateError(f"not a binding of version {BIND_VERSION}")
    if data.get("instance") != instance:
        raise StateError(f"names instance {data.get('instance')!r:.40}, not {instance}")
    ns_id = data.get("ns_id")
    if not isinstance(ns_id, str) or not NS_ID_RE.fullmatch(ns_id):
        raise StateError(f"ns_id {ns_id!r:.40} is not a namespace id")
    return Binding(instance, ns_id, timestamp(data, "bound_at", "binding"))


def db_bindings(store: Store) -> dict[str, Binding]:
    """instance → binding, as the DB has them."""
    return {i: Binding(i, ns, at) for i, ns, at in registry_sql.all_bindings(store.conn)}


def restore(store: Store, files: dict[str, Binding]) -> list[str]:
    """Bind each instance the DB does not know to the namespace its file names, if that is
    registered (its manifest was read). Call inside a transaction; returns those bound.

    An instance bound meanwhile (an init) keeps its binding: the file may be older."""
    restored = []
    for b in files.values():
        if registry_sql.bind_if_new(store.conn, b.instance, b.ns_id, b.bound_at):
            restored.append(b.instance)
    return restored


def _stale(store: Store, files: dict[str, Binding]) -> list[Binding]:
    """The DB's bindings whose file is absent, damaged, or names another namespace."""
    return [
        b
        for inst, b in sorted(db_bindings(store).items())
        if inst not in files or files[inst].ns_id != b.ns_id
    ]


def write_down(layout: Layout, store: Store, files: dict[str, Binding]) -> None:
    """Rewrite from the DB every binding file that differs from it (see the module docstring).

    Checked again under the root lock: an init may have bound between our reads of the DB
    and of the files. A failure is logged, never raised: the DB still serves, and the next
    command tries again."""
    if not _stale(store, files):
        return
    try:
        with root_lock(layout, timeout=REPAIR_LOCK_WAIT):
            for binding in _stale(store, read_bindings(layout)[0]):
                write_binding(layout, binding)
                log.info("binding written down from the state DB",
                         extra={"instance": binding.instance, "ns": binding.ns_id})  # fmt: skip
    except ConflictError:  # an init or purge holds it: it is binding right now
        log.info("binding files not brought in line with the state DB: root lock busy")
    except CachemgrError as e:
        log.warning("binding files not brought in line with the state DB; retried next time",
                    extra={"error": str(e)})  # fmt: skip


def bound_by_files(layout: Layout) -> set[str]:
    """The namespaces some binding file names (GC's last check before dropping one)."""
    return {b.ns_id for b in read_bindings(layout)[0].values()}
