"""Carry out a GC plan: delete through cachemgr.fs.deletion, keep the index, audit each step."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from cachemgr.errors import UnsafePathError
from cachemgr.fs.deletecheck import too_young
from cachemgr.fs.deletion import (
    DeleteReport,
    Pacer,
    Progress,
    delete_files,
    delete_own_temps,
)
from cachemgr.fs.dirscan import list_files
from cachemgr.fs.locks import root_lock
from cachemgr.fs.safe import open_dir
from cachemgr.gc.plan import GcPlan, GcStep
from cachemgr.gc.policy import ByReason, Reason, tally
from cachemgr.layout import Layout
from cachemgr.ns.bindings import bound_by_files
from cachemgr.ns.purge import drop_unbound, rename_to_trash
from cachemgr.ns.trash import drain_entry
from cachemgr.sglang.liveuse import live_users
from cachemgr.state.store import Store

log = logging.getLogger("cachemgr.gc.plan")
InUse = Callable[[Path], list[int]]  # the pids using a dir as their storage dir (liveuse.py)
# Names per delete call: each chunk's index rows and its audit row are written in one
# transaction once its files are gone, so a kill -9 leaves at most one chunk unaudited.
CHUNK = 256


@dataclass(frozen=True)
class StepResult:
    """What one plan step did (or, in a dry run, would do)."""

    reason: Reason
    rel_dir: str
    namespace_id: str | None
    planned_files: int
    planned_bytes: int
    files: int = 0
    bytes: int = 0
    vanished: int = 0
    young: int = 0
    refused: tuple[str, ...] = ()
    skipped: str | None = None  # why the whole step was not carried out


@dataclass(frozen=True)
class GcReport(ByReason):
    """The outcome of one GC run."""

    dry_run: bool
    leader: bool
    started_at: float
    finished_at: float
    steps: tuple[StepResult, ...] = ()
    warnings: tuple[str, ...] = ()
    holder: str | None = None  # who leads GC when this process does not

    def totals(self) -> dict[Reason, tuple[int, int]]:
        """(files, bytes) per reason."""
        return tally((s.reason, s.files, s.bytes) for s in self.steps)


@dataclass
class _Tally:
    """Running totals across steps, for one progress callback over the whole run."""

    progress: Progress | None
    files: int = 0
    bytes: int = 0

    def offset(self) -> Progress | None:
        base_f, base_b, report = self.files, self.bytes, self.progress
        if report is None:
            return None
        return lambda f, b: report(base_f + f, base_b + b)

    def add(self, r: DeleteReport) -> None:
        self.files += r.files
        self.bytes += r.bytes


def execute_gc(
    plan: GcPlan,
    store: Store,
    layout: Layout,
    *,
    dry_run: bool = False,
    actor: str = "cli",
    pacer: Pacer | None = None,
    progress: Progress | None = None,
    clock: Callable[[], float] = time.time,
    stop: Callable[[], bool] = lambda: False,
    in_use: InUse = live_users,
) -> GcReport:
    """Run the plan's steps in order; a dry run stats the same files and deletes none.

    `stop()` true (a shutdown) ends the run after the chunk being deleted. `in_use` names the
    running processes whose storage dir a namespace is (none may lose it as unbound).
    """
    started = clock()
    tally = _Tally(progress)
    results = []
    for step in plan.steps:
        if stop():
            break
        try:
            result = _run_step(
                step, store, layout, dry_run, actor, pacer, tally, clock, stop, in_use
            )
        except UnsafePathError as e:  # its dir became a symlink: the other steps still run
            log.warning("gc step refused", extra={"dir": step.rel_dir, "error": str(e)})
            result = StepResult(
                step.reason, step.rel_dir, step.namespace_id, len(step.names), step.bytes,
                skipped=f"refused: {e}",
            )  # fmt: skip
        results.append(result)
    report = GcReport(dry_run, True, started, clock(), tuple(results), plan.warnings)
    _log_summary(report, actor)
    return report


def _run_step(
    step: GcStep,
    store: Store,
    layout: Layout,
    dry_run: bool,
    actor: str,
    pacer: Pacer | None,
    tally: _Tally,
    clock: Callable[[], float],
    stop: Callable[[], bool],
    in_use: InUse,
) -> StepResult:
    base = StepResult(step.reason, step.rel_dir, step.namespace_id, len(step.names), step.bytes)
    if step.reason in ("unbound", "ttl") and step.remove_dir and step.namespace_id and not dry_run:
        return _drop_namespace(step, base, store, layout, actor, pacer, tally, clock, in_use)
    kept = step.reason in ("unbound", "ttl") and _kept(store, layout, step.namespace_id, in_use)
    if kept:  # a dry run says what the drop would find under the lock
        return replace(base, skipped=kept)
    if step.reason == "trash":  # the same path as a purge's own drain, audited there
        entry = step.rel_dir.removeprefix(".trash/")
        r = drain_entry(
            layout, store, entry, actor=actor, pacer=pacer, progress=tally.offset(),
            dry_run=dry_run,
        )  # fmt: skip
        tally.add(r)
        return _done(base, r)
    if step.namespace_id is None and step.reason == "tmp":
        return _sweep_own_temps(step, base, store, layout, dry_run, actor, clock)
    total = DeleteReport(dry_run=dry_run)
    for i in range(0, len(step.names), CHUNK):
        if stop():
            base = replace(base, skipped="stopped: the daemon is shutting down")
            break
        gone: list[str] = []
        before = _dir_id(layout, step.rel_dir)
        # Unpaced here, paced below once the chunk is recorded: a kill -9 during the pacer's
        # sleep (where a paced run spends its time) then finds audit and index exact.
        r = delete_files(
            layout.root, step.rel_dir, step.names[i : i + CHUNK], dry_run=dry_run,
            min_age=step.min_age, progress=tally.offset(), now=clock, removed=gone.append,
        )  # fmt: skip
        tally.add(r)
        total += r
        if before is None or _dir_id(layout, step.rel_dir) != before:
            # A purge renamed the dir away meanwhile: what was unlinked may lie in .trash/
            # and the purge dropped those rows and audited its pages; rows now are the new
            # dir's, so keep them.
            base = replace(base, skipped="the namespace was purged during GC")
            break
        if not dry_run:
            _record_chunk(store, step, gone, r, actor, clock())
        _pace(pacer, r.files)
    return _done(base, total)


def _done(base: StepResult, r: DeleteReport) -> StepResult:
    """The step's result once `r` is what its deletion did."""
    return replace(
        base, files=r.files, bytes=r.bytes, vanished=r.vanished, young=r.young, refused=r.refused
    )


def _pace(pacer: Pacer | None, files: int) -> None:
    """Count `files` deletions on the pacer, sleeping there if they came too fast."""
    if pacer is not None:
        for _ in range(files):
            pacer.tick()


def _record_chunk(
    store: Store, step: GcStep, gone: list[str], r: DeleteReport, actor: str, at: float
) -> None:
    """Drop the index rows of a deleted chunk and audit it, in one transaction: whenever a
    kill -9 lands, the audit holds exactly the evictions whose rows left the index."""
    if not (gone or r.files):
        return
    with store.transaction() as conn:
        if gone and step.namespace_id is not None and step.rel_dir.startswith("ns/"):
            conn.executemany(
                "DELETE FROM pages WHERE namespace_id = ? AND name = ?",
                [(step.namespace_id, n) for n in gone],
            )
        if r.files:
            store.audit(
                "evict", namespace_id=step.namespace_id, reason=step.reason, actor=actor,
                pages=r.files, bytes_=r.bytes, at=at,
            )  # fmt: skip


def _sweep_own_temps(
    step: GcStep,
    base: StepResult,
    store: Store,
    layout: Layout,
    dry_run: bool,
    actor: str,
    clock: Callable[[], float],
) -> StepResult:
    """Delete temps cachemgr's own atomic writes left (gcfind.own_temps), audited as `tmp`."""
    r = delete_own_temps(
        layout.root, step.rel_dir, step.names, older_than=step.min_age, now=clock,
        dry_run=dry_run,
    )  # fmt: skip
    if not dry_run:
        _record_chunk(store, step, [], r, actor, clock())  # no index rows: only the audit
    return _done(base, r)


def _drop_namespace(
    step: GcStep,
    base: StepResult,
    store: Store,
    layout: Layout,
    actor: str,
    pacer: Pacer | None,
    tally: _Tally,
    clock: Callable[[], float],
    in_use: InUse,
) -> StepResult:
    """Drop an unbound namespace as a purge does: under the root lock, re-check that no server
    uses it, rename its dir into .trash/ (constant time), and only then delete from there.

    Deleting inside ns/<id> would race an init that binds it meanwhile (its server would
    find its pages gone and its dir removed); init takes the same lock, so the two serialize.
    Min-age is checked on the renamed dir, where no writer can add a file any more: one file
    younger than min_age and the dir goes back, the drop deferred whole (the namespace is
    left exactly as it was, to be dropped by a later run once its files are old enough).
    """
    ns_id = step.namespace_id
    assert ns_id is not None
    with root_lock(layout):
        if kept := _kept(store, layout, ns_id, in_use):
            return replace(base, skipped=kept)
        entry = rename_to_trash(layout, ns_id, recreate=False)
        held = list(list_files(layout, f".trash/{entry}")) if entry else []
        now = clock()
        young = sum(too_young(f.mtime, step.min_age, now) for f in held)
        if entry is not None and young:
            why = _put_back(layout, entry, ns_id)
            return replace(base, young=young, skipped=f"{young} files younger than min_age "
                           f"({step.min_age:g}s): drop deferred{why}")  # fmt: skip
        with store.transaction() as conn:
            drop_unbound(layout, store, ns_id)
            # Its rows go with it, under the lock: a fresh dir an init makes next has its own.
            conn.execute("DELETE FROM pages WHERE namespace_id = ?", (ns_id,))
            if held:  # audited as its rows leave the index, like each chunk of an eviction
                store.audit(
                    "evict", namespace_id=ns_id, reason=step.reason, actor=actor,
                    pages=len(held), bytes_=sum(f.size for f in held), at=now,
                )  # fmt: skip
    if entry is None:
        return base  # no dir: nothing to delete, the registry is in line
    r = drain_entry(
        layout, store, entry, actor=actor, pacer=pacer, progress=tally.offset(),
        min_age=step.min_age, audit_as=None,
    )  # fmt: skip
    tally.add(r)
    return _done(base, r)


def _put_back(layout: Layout, entry: str, ns_id: str) -> str:
    """Rename .trash/<entry> back to ns/<id> (under the root lock); '' or why it stayed."""
    with open_dir(layout.root, "ns") as ns_fd, open_dir(layout.root, ".trash") as trash_fd:
        try:
            os.rename(entry, ns_id, src_dir_fd=trash_fd, dst_dir_fd=ns_fd)
        except OSError as e:  # ns/<id> recreated meanwhile and not empty
            log.warning("gc could not put a namespace back", extra={"entry": entry,
                        "error": e.strerror})  # fmt: skip
            return f"; left in .trash/{entry}: {e.strerror}"
    return ""


def _dir_id(layout: Layout, rel_dir: str) -> tuple[int, int] | None:
    """(device, inode) of <root>/<rel_dir>, None if absent: tells a dir renamed away."""
    try:
        st = os.stat(layout.root / rel_dir, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _kept(store: Store, layout: Layout, ns_id: str | None, in_use: InUse) -> str | None:
    """Why an unbound namespace stays after all: a server bound it since the plan was made (in
    the DB, or in a binding file the DB has not read back yet), or a running process on this
    host has it as its storage dir (a server started before its instance moved elsewhere)."""
    row = store.conn.execute("SELECT 1 FROM bindings WHERE namespace_id = ?", (ns_id,)).fetchone()
    if ns_id is None or row is not None or ns_id in bound_by_files(layout):
        return "a server bound this namespace after the plan was made"
    pids = in_use(layout.ns_dir(ns_id))
    if pids:
        return f"a running process uses it as its storage dir (pid {', '.join(map(str, pids[:3]))})"
    return None


def _log_summary(report: GcReport, actor: str) -> None:
    by_reason = {r: {"files": f, "bytes": b} for r, (f, b) in report.totals().items()}
    log.info(
        "gc dry run" if report.dry_run else "gc done",
        extra={
            "actor": actor, "files": report.files, "bytes": report.bytes,
            "by_reason": by_reason, "seconds": round(report.finished_at - report.started_at, 3),
            "warnings": list(report.warnings),
        },
    )  # fmt: skip
