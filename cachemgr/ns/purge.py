"""Purge: drop whole namespaces in constant time, then delete their files at leisure.

A purge renames <root>/ns/<id>/ to <root>/.trash/<id>.<unique> (one rename, whatever the
size), recreates ns/<id>/ empty at once if an instance is bound to it (SGLang keeps writing to
its path), and leaves the files to `drain_trash`: in the foreground for the CLI, in a thread for
the daemon, and again on any later run after a crash.

Manifests: a namespace purged while bound keeps its manifest (same identity, recreated empty);
an unbound one loses it (its DB row stays, state `purged`, for history).

Audit: each purged namespace gets one row `purge` when it is renamed away (reason, actor, and
the pages/bytes counted by the plan); each trash entry gets one row `delete-trash` when its
deletion finishes (actor, and the pages/bytes actually deleted). A deletion killed midway
records only what the resuming run deleted.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Unpack

from cachemgr.errors import (
    CachemgrError,
    ConfigError,
    RootNotWritable,
    StateError,
    UnsafePathError,
)
from cachemgr.fs import reserve
from cachemgr.fs.deletion import delete_manifest
from cachemgr.fs.exchange import exchange
from cachemgr.fs.locks import root_lock
from cachemgr.fs.safe import make_dir, open_dir, open_dir_at, write_atomic_at
from cachemgr.fs.tree import identities
from cachemgr.layout import NS_DIR, TRASH_DIR, Layout
from cachemgr.ns import bindings, purge_intent
from cachemgr.ns import registry as nsreg
from cachemgr.ns.liveuse import live_users
from cachemgr.ns.manifest import Manifest, read_manifest, write_manifest
from cachemgr.ns.purge_intent import SWAPPED
from cachemgr.ns.purge_plan import PurgePlan, PurgeTarget, Selector, plan_purge  # re-exported
from cachemgr.ns.runcontext import DirUsers
from cachemgr.ns.trash import (  # re-exported: purge and trash are one API for callers
    Actor,
    DrainProgress,
    TrashEntry,
    describe_trash,
    drain_trash,
    list_trash,
)
from cachemgr.state import pages_sql, trash_sql
from cachemgr.state.intents_sql import Intent
from cachemgr.state.store import Store

__all__ = [
    "Actor",
    "DrainProgress",
    "PurgePlan",
    "PurgeReason",
    "PurgeResult",
    "PurgeTarget",
    "Purged",
    "Selector",
    "TrashEntry",
    "describe_trash",
    "drain_trash",
    "drop_unbound",
    "execute_purge",
    "list_trash",
    "manifest_or_none",
    "plan_purge",
    "purge",
    "rebound",
    "rename_to_trash",
]

PurgeReason = Literal["identity_change", "manual", "unbound", "mismatch"]


@dataclass(frozen=True)
class Purged:
    """One namespace renamed away: where to, and whether its dir came back empty."""

    ns_id: str
    trash_name: str | None  # None: it had no dir
    recreated: bool
    manifest_removed: bool
    pages: int
    bytes: int


@dataclass(frozen=True)
class PurgeResult:
    purged: tuple[Purged, ...]
    actor: Actor
    reason: PurgeReason
    at: float


def execute_purge(
    plan: PurgePlan,
    layout: Layout,
    store: Store,
    *,
    actor: Actor,
    reason: PurgeReason,
    now: Callable[[], float] = time.time,
    in_use: DirUsers = live_users,
) -> PurgeResult:
    """Rename each target into .trash/ (recreating empty those bound, or in use by a running
    process on this host: `in_use`), audit; no file deleted."""
    done: list[Purged] = []
    run = _Run(actor, reason, now, in_use)
    with root_lock(layout):
        purge_intent.settle_all(layout, store)  # of a purge killed before its commit
        for target in plan.targets:
            purged = _purge_one(plan, target, layout, store, run)
            if purged is not None:
                done.append(purged)
    return PurgeResult(purged=tuple(done), actor=actor, reason=reason, at=now())


@dataclass(frozen=True)
class _Run:
    """Who purges, why, the clock, and who uses a dir: the same for each target."""

    actor: Actor
    reason: PurgeReason
    at: Callable[[], float]
    in_use: DirUsers


def _purge_one(
    plan: PurgePlan, target: PurgeTarget, layout: Layout, store: Store, run: _Run
) -> Purged | None:
    """Purge one target in one write transaction, taken before anything moves: a DB another
    process holds locked fails the purge before the rename (StateLocked, nothing changed), and
    once the rename (the commit point) is done, its rows and audit are written in the
    transaction already held, before the caller answers. Its intent (the audit row) is
    committed just before the rename (cachemgr.ns.purge_intent): a kill after the rename does
    not lose it. None: nothing left to do."""
    with store.transaction():
        # Bindings are re-read under the lock: the plan may be older than a concurrent init.
        # In a fleet the lock is this node's only, and the plan took a count of every page:
        # another node's init binds meanwhile, and only its file says so (docs/fleet.md).
        if layout.node is not None:
            bindings.read_in(layout, store)
        instances = nsreg.instances_of(store, target.ns_id)
        # An unbound dir a running server uses (started before its instance moved, --on-change
        # retain) is kept as a bound one is: the server keeps its path, as GC never drops it.
        users = () if instances else run.in_use(layout.ns_dir(target.ns_id))
        kept = bool(instances or users)
        if kept and plan.only_unbound:
            return None
        if _done_meanwhile(layout, target, bound=kept):
            return None  # another purge (an init, GC) got there since the plan, and audited it
        manifest = manifest_or_none(layout, target.ns_id) if not kept else None
        # What moves, for its drain's count: the live index's now, not the plan's (a bound
        # namespace is written to while a person reads the prompt).
        moved = pages_sql.namespace_usage(store.conn, target.ns_id) if plan.indexed else None
        found = purge_intent.dir_id(layout, target.ns_id)
        intent = _intent(target, run, found or (0, 0))  # (0, 0): no dir, nothing to record
        if found is not None:
            purge_intent.record(store, intent)
        trash_name = rename_to_trash(layout, target.ns_id, recreate=kept, name=intent.entry)
        removed, recreated = False, kept
        if not kept:
            removed = drop_unbound(layout, store, target.ns_id)
            if rebound(layout, store, target.ns_id, manifest):
                removed, recreated = False, True
        else:
            pages_sql.delete_namespace_pages(store.conn, target.ns_id)
        # Its drain then starts without a count to take first. Not in a fleet: a node's DB
        # is its own, and another node's drains would not count it down.
        pages, size = moved or (target.pages, target.bytes)
        if trash_name is not None and pages and layout.node is None:
            trash_sql.record(store.conn, trash_name, pages, size)
        if found is None:  # nothing moved outside this transaction
            purge_intent.audit(store, intent)
        else:  # (unless a drain of its entry did meanwhile)
            purge_intent.audit_once(store, intent)
    return Purged(target.ns_id, trash_name, recreated, removed, target.pages, target.bytes)


def _intent(target: PurgeTarget, run: _Run, found: tuple[int, int]) -> Intent:
    """The purge of `target` as its audit row will say, and the dir it moves (`found`)."""
    return Intent(
        entry=trash_name_for(target.ns_id),
        namespace_id=target.ns_id,
        reason=run.reason,
        actor=run.actor,
        pages=target.pages,
        bytes=target.bytes,
        at=run.at(),
        dev=found[0],
        ino=found[1],
    )


def manifest_or_none(layout: Layout, ns_id: str) -> Manifest | None:
    """In a fleet, the manifest `rebound` may have to put back (None: none, or damaged)."""
    if layout.node is None:
        return None
    try:
        return read_manifest(layout, ns_id)
    except StateError:
        return None


def rebound(layout: Layout, store: Store, ns_id: str, manifest: Manifest | None) -> bool:
    """In a fleet, once an unbound namespace's dir and manifest are gone: whether another
    node's init bound it since the binding files were last read; if so its dir is made again,
    empty, with its manifest, as for a namespace purged while bound. That init makes both
    again itself after it writes its binding file (cachemgr.ns.prelaunch): whichever of the
    two goes second sees the other's change, so the window the root lock (one node's) leaves
    open is closed. Call inside the purge's transaction."""
    if layout.node is None or ns_id not in bindings.bound_by_files(layout):
        return False  # one node: its root lock serializes every init and purge
    nsreg.make_ns_dir(layout, ns_id)
    if manifest is not None:
        write_manifest(layout, manifest)
        nsreg.register(store, manifest)
    bindings.read_in(layout, store)
    return True


def _done_meanwhile(layout: Layout, target: PurgeTarget, *, bound: bool) -> bool:
    """Whether a target planned before the root lock was taken has nothing left to purge:
    its dir moved away, or (bound) recreated empty, or (unbound) gone with its manifest."""
    if nsreg.ns_entry_kind(layout, target.ns_id) == "absent":
        return target.has_dir or not (bound or os.path.lexists(layout.manifest(target.ns_id)))
    if not bound:
        return False
    with open_dir(layout.root, f"ns/{target.ns_id}") as fd:
        return _as_recreated(fd)


def _as_recreated(ns_fd: int) -> bool:
    """Whether a namespace dir holds what a purge recreates it with and nothing more: nothing,
    or (vLLM) only its folders' identity files, which the purge carried over. A second purge
    of a bound vLLM namespace otherwise moved those again and audited itself too."""
    names = os.listdir(ns_fd)
    if not names:
        return True
    found = identities(ns_fd)
    if set(names) != set(found):
        return False
    for folder, (name, _) in found.items():
        with open_dir_at(ns_fd, folder) as fd:
            if os.listdir(fd) != [name]:
                return False
    return True


def drop_unbound(layout: Layout, store: Store, ns_id: str) -> bool:
    """An unbound namespace's files are gone (purge, GC): drop its manifest, mark it purged.

    Returns whether a manifest was removed. Call inside a transaction.
    """
    removed = delete_manifest(layout.root, ns_id)
    nsreg.mark_purged(store, ns_id)
    return removed


def trash_name_for(ns_id: str) -> str:
    """A new, unique name in .trash/ for ns/<id>."""
    return f"{ns_id}.{time.time_ns():x}{secrets.token_hex(3)}"


def rename_to_trash(
    layout: Layout, ns_id: str, *, recreate: bool, name: str | None = None
) -> str | None:
    """Move ns/<id> into .trash/ (None if it has no dir), as `name` (default: a new one; a
    dir recreated empty makes it `name` + "n"); recreate it empty if asked.

    The empty dir is made first, in .trash/ (a crash leaves an empty entry the drain removes),
    and swapped with ns/<id> in one step (cachemgr.fs.exchange; two renames where the
    filesystem cannot): a full disk then fails the purge before anything moved, and no kill
    leaves a bound instance without its dir (a rename needs no new blocks; a mkdir does).
    """
    trash_name = name or trash_name_for(ns_id)
    with open_dir(layout.root, NS_DIR) as ns_fd, open_dir(layout.root, TRASH_DIR) as trash_fd:
        try:
            st = os.stat(ns_id, dir_fd=ns_fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise UnsafePathError(f"{layout.ns_dir(ns_id)} is not a directory; left alone")
        fresh = _empty_dir(layout, trash_fd, f"{trash_name}{SWAPPED}") if recreate else None
        if fresh is not None and st is not None:
            _carry_identities(ns_fd, ns_id, trash_fd, fresh)
            if _swap(layout, ns_fd, ns_id, trash_fd, fresh):
                return fresh  # the old dir now has the empty one's name in .trash/
        if st is not None:
            try:
                os.rename(ns_id, trash_name, src_dir_fd=ns_fd, dst_dir_fd=trash_fd)
            except OSError as e:
                what = f"cannot move {layout.ns_dir(ns_id)} into {layout.trash}: {e.strerror}"
                raise _cannot(what, e) from e
        if fresh is not None:
            os.rename(fresh, ns_id, src_dir_fd=trash_fd, dst_dir_fd=ns_fd)
    return trash_name if st is not None else None


def _swap(layout: Layout, ns_fd: int, ns_id: str, trash_fd: int, fresh: str) -> bool:
    """Exchange ns/<id> with the empty .trash/<fresh>; False where the filesystem cannot."""
    try:
        return exchange(trash_fd, fresh, ns_fd, ns_id)
    except OSError as e:
        what = f"cannot move {layout.ns_dir(ns_id)} into {layout.trash}: {e.strerror}"
        raise _cannot(what, e) from e


def _carry_identities(ns_fd: int, ns_id: str, trash_fd: int, fresh: str) -> None:
    """Copy the identity files of ns/<id> (vLLM's `<model>_<digest>/config.json`) into its
    empty successor before it takes the name. vLLM writes that file only at start, and only
    if absent: without it the server's later blocks are never vouched for, never indexed and
    never evicted. Only files that vouch for their own folder are copied."""
    with open_dir_at(ns_fd, ns_id) as old:
        found = identities(old)
    with open_dir_at(trash_fd, fresh) as new:
        for folder, (name, raw) in found.items():
            make_dir(folder, new)
            with open_dir_at(new, folder) as fd:
                write_atomic_at(fd, name, raw)


def _empty_dir(layout: Layout, dir_fd: int, name: str) -> str:
    """mkdir `name` in `dir_fd`; on a full disk, once more after giving the DB's reserve back."""
    try:
        make_dir(name, dir_fd)
    except OSError as e:
        if not (reserve.is_disk_full(e) and reserve.release(layout.state_dir)):
            raise _no_room(layout, e) from e
        try:
            make_dir(name, dir_fd)
        except OSError as again:
            raise _no_room(layout, again) from again
    return name


def _no_room(layout: Layout, e: OSError) -> CachemgrError:
    if reserve.is_disk_full(e):
        return CachemgrError(
            f"no space on {layout.root} to recreate a bound namespace's dir; nothing moved: "
            "free space first (`cachemgr gc --yes`, or purge unbound namespaces)"
        )
    return _cannot(f"cannot create a dir in {layout.trash}: {e.strerror}", e)


def _cannot(what: str, e: OSError) -> CachemgrError:
    """A read-only or forbidden root is the root's state, not a bad setting or request."""
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return RootNotWritable(f"{what}; nothing was moved")
    return ConfigError(what)


def purge(
    layout: Layout,
    store: Store,
    *,
    actor: Actor,
    reason: PurgeReason,
    count: bool = True,
    **selector: Unpack[Selector],
) -> tuple[PurgePlan, PurgeResult]:
    """Plan and execute under one hold of the root lock (for callers with no prompt between).

    `count=False` skips the stat scan of the targets (seconds for 10^5 pages on a busy disk):
    the rename then returns in milliseconds and the `delete-trash` audit rows carry the counts.
    """
    with root_lock(layout):
        plan = plan_purge(layout, store, count=count, **selector)
        return plan, execute_purge(plan, layout, store, actor=actor, reason=reason)
