"""Dropping an unbound namespace during GC: under the root lock, after re-checking that no
server bound it since the plan and no running process uses it."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from cachemgr.fs.deletecheck import too_young
from cachemgr.fs.deletion import Progress
from cachemgr.fs.dirscan import list_files
from cachemgr.fs.locks import root_lock
from cachemgr.fs.safe import open_dir
from cachemgr.gc.step import GcStep, StepResult
from cachemgr.layout import Layout
from cachemgr.ns import purge_intent
from cachemgr.ns.bindings import bound_by_files
from cachemgr.ns.purge import (
    drop_unbound,
    manifest_or_none,
    rebound,
    rename_to_trash,
    trash_name_for,
)
from cachemgr.ns.runcontext import RunContext
from cachemgr.ns.trash import drain_entry, trash_format
from cachemgr.state import intents_sql, pages_sql, registry_sql
from cachemgr.state.intents_sql import Intent

log = logging.getLogger(__name__)


def drop_namespace(run: RunContext, step: GcStep, progress: Progress | None) -> StepResult:
    """Drop an unbound namespace as a purge does: under the root lock, re-check that no server
    uses it, rename its dir into .trash/ (constant time), and only then delete from there.

    Deleting inside ns/<id> would race an init that binds it meanwhile (its server would
    find its pages gone and its dir removed); init takes the same lock, so the two serialize.
    Min-age is checked on the renamed dir, where no writer can add a file any more: one file
    younger than min_age and the dir goes back, the drop deferred whole (the namespace is
    left exactly as it was, to be dropped by a later run once its files are old enough).
    """
    layout = run.layout
    store = run.store
    base = StepResult(step)
    ns_id = step.namespace_id
    assert ns_id is not None
    with root_lock(layout):
        if why := why_stays(run, ns_id):
            return replace(base, skipped=why)
        # Asked again here, not only before the step: the root lock may have kept it waiting
        # (or it was paused) past its GC lease, and the rename takes the whole namespace.
        if run.stop():
            return replace(base, skipped="stopped: shutting down, or the GC lease was lost")
        purge_intent.settle_all(layout, store)  # of a purge or drop killed before its commit
        # The write lock first: a DB held locked elsewhere fails the drop before the rename.
        with store.transaction() as conn:
            manifest = manifest_or_none(layout, ns_id)
            now = run.clock()
            intent = _intent(run, step, ns_id, now)
            if intent is not None:  # committed before the rename: a kill after it loses no row
                purge_intent.record(store, intent)
            entry = rename_to_trash(
                layout, ns_id, recreate=False, name=None if intent is None else intent.entry
            )
            trash = f".trash/{entry}"
            held = list(list_files(layout, trash, fmt=trash_format(layout, entry))) if entry else []
            young = sum(too_young(f.mtime, step.min_age, now) for f in held)
            # This transaction settles the intent (no drain can meanwhile: it holds the lock).
            settled = intent is not None and intents_sql.delete(conn, intent.entry)
            if entry is not None and young:
                why = _put_back(layout, entry, ns_id)
                return replace(
                    base,
                    young=young,
                    skipped=f"{young} files younger than "
                    f"min_age ({step.min_age:g}s): drop deferred{why}",
                )
            drop_unbound(layout, store, ns_id)
            # (a fleet: bound on another node since why_stays read the files, it gets its dir
            # back empty; what it held was to be dropped, and is)
            rebound(layout, store, ns_id, manifest)
            # Its rows go with it, under the lock: a fresh dir an init makes next has its own.
            pages_sql.delete_namespace_pages(conn, ns_id)
            if held and settled:  # audited as its rows leave the index, like an eviction's chunk
                store.audit(
                    "evict",
                    namespace_id=ns_id,
                    reason=step.reason,
                    actor=run.actor,
                    pages=len(held),
                    bytes_=sum(f.size for f in held),
                    at=now,
                )
    if entry is None:
        return base  # no dir: nothing to delete, the registry is in line
    r = drain_entry(run, entry, progress=progress, min_age=step.min_age, audit_as=None)
    return base.done(r)


def _intent(run: RunContext, step: GcStep, ns_id: str, now: float) -> Intent | None:
    """The drop's `evict` audit row as the plan counted it, and the dir it moves; None if
    ns/<id> is no dir (nothing moves outside the transaction)."""
    found = purge_intent.dir_id(run.layout, ns_id)
    if found is None:
        return None
    return Intent(
        entry=trash_name_for(ns_id),
        namespace_id=ns_id,
        reason=step.reason,
        actor=run.actor,
        pages=len(step.names),
        bytes=step.bytes,
        at=now,
        dev=found[0],
        ino=found[1],
        action="evict",
    )


def _put_back(layout: Layout, entry: str, ns_id: str) -> str:
    """Rename .trash/<entry> back to ns/<id> (under the root lock); '' or why it stayed."""
    with open_dir(layout.root, "ns") as ns_fd, open_dir(layout.root, ".trash") as trash_fd:
        try:
            os.rename(entry, ns_id, src_dir_fd=trash_fd, dst_dir_fd=ns_fd)
        except OSError as e:  # ns/<id> recreated meanwhile and not empty
            log.warning(
                "gc could not put a namespace back", extra={"entry": entry, "error": e.strerror}
            )
            return f"; left in .trash/{entry}: {e.strerror}"
    return ""


def why_stays(run: RunContext, ns_id: str | None) -> str | None:
    """Why an unbound namespace stays after all: a server bound it since the plan was made (in
    the DB, or in a binding file the DB has not read back yet), or a running process on this
    host has it as its storage dir (a server started before its instance moved elsewhere)."""
    layout = run.layout
    if (
        ns_id is None
        or registry_sql.is_bound(run.store.conn, ns_id)
        or ns_id in bound_by_files(layout)
    ):
        return "a server bound this namespace after the plan was made"
    pids = run.users(layout.ns_dir(ns_id))
    if pids:
        return f"a running process uses it as its storage dir (pid {', '.join(map(str, pids[:3]))})"
    return None
