"""Carry out a GC plan: delete through cachemgr.fs.deletion, keep the index, audit each step."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

from cachemgr.errors import UnsafePathError
from cachemgr.fs.deletion import DeleteReport, Pacer, Progress, delete_files
from cachemgr.fs.locks import root_lock
from cachemgr.gc.plan import GcPlan, GcStep
from cachemgr.gc.policy import ByReason, Reason, tally
from cachemgr.layout import Layout
from cachemgr.ns.purge import drop_unbound, rename_to_trash
from cachemgr.ns.trash import drain_entry
from cachemgr.state.store import Store

log = logging.getLogger("cachemgr.gc.plan")
CHUNK = 4096  # names per delete call: index rows are dropped per chunk, one transaction each


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
) -> GcReport:
    """Run the plan's steps in order; a dry run stats the same files and deletes none.

    `stop()` true (a shutdown) ends the run after the chunk being deleted.
    """
    started = clock()
    tally = _Tally(progress)
    results = []
    for step in plan.steps:
        if stop():
            break
        try:
            result = _run_step(step, store, layout, dry_run, actor, pacer, tally, clock, stop)
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
) -> StepResult:
    base = StepResult(step.reason, step.rel_dir, step.namespace_id, len(step.names), step.bytes)
    if step.reason in ("unbound", "ttl") and _bound(store, step.namespace_id):
        return replace(base, skipped="a server bound this namespace after the plan was made")
    if step.reason in ("unbound", "ttl") and step.remove_dir and step.namespace_id and not dry_run:
        return _drop_namespace(step, base, store, layout, actor, pacer, tally)
    if step.reason == "trash":  # the same path as a purge's own drain, audited there
        entry = step.rel_dir.removeprefix(".trash/")
        r = drain_entry(
            layout, store, entry, actor=actor, pacer=pacer, progress=tally.offset(),
            dry_run=dry_run,
        )  # fmt: skip
        tally.add(r)
        return replace(
            base, files=r.files, bytes=r.bytes, vanished=r.vanished, young=r.young,
            refused=r.refused,
        )  # fmt: skip
    total = DeleteReport(dry_run=dry_run)
    # Index rows are dropped by a helper thread while the next chunk is unlinked: both wait
    # in the kernel or SQLite without the GIL, so on two cores the index costs no delete rate.
    # Only that thread touches the connection until it is joined below.
    forget = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gc-index")
    pending: list[Future[None]] = []
    try:
        for i in range(0, len(step.names), CHUNK):
            if stop():
                base = replace(base, skipped="stopped: the daemon is shutting down")
                break
            gone: list[str] = []
            before = _dir_id(layout, step.rel_dir)
            r = delete_files(
                layout.root, step.rel_dir, step.names[i : i + CHUNK], dry_run=dry_run,
                min_age=step.min_age, pacer=pacer, progress=tally.offset(), now=clock,
                removed=gone.append,
            )  # fmt: skip
            tally.add(r)
            total += r
            if before is None or _dir_id(layout, step.rel_dir) != before:
                # A purge renamed the dir away meanwhile: what was unlinked may lie in .trash/
                # and the purge dropped those rows; rows now are the new dir's, so keep them.
                base = replace(base, skipped="the namespace was purged during GC")
                break
            pending.append(forget.submit(_forget, store, step.namespace_id, step.rel_dir, gone))
        forget.shutdown(wait=True)
        for done in pending:
            done.result()  # an index failure surfaces here, not lost in the thread
    finally:
        forget.shutdown(wait=True)
        if not dry_run and (total.files or total.bytes):
            store.audit(
                "evict", namespace_id=step.namespace_id, reason=step.reason, actor=actor,
                pages=total.files, bytes_=total.bytes, at=clock(),
            )  # fmt: skip
    return replace(
        base, files=total.files, bytes=total.bytes, vanished=total.vanished,
        young=total.young, refused=total.refused,
    )  # fmt: skip


def _drop_namespace(
    step: GcStep,
    base: StepResult,
    store: Store,
    layout: Layout,
    actor: str,
    pacer: Pacer | None,
    tally: _Tally,
) -> StepResult:
    """Drop an unbound namespace as a purge does: under the root lock, re-check that no server
    bound it, rename its dir into .trash/ (constant time), and only then delete from there.

    Deleting inside ns/<id> would race an init that binds it meanwhile (its server would
    find its pages gone and its dir removed); init takes the same lock, so the two serialize.
    """
    ns_id = step.namespace_id
    assert ns_id is not None
    with root_lock(layout):
        if _bound(store, ns_id):
            return replace(base, skipped="a server bound this namespace after the plan was made")
        entry = rename_to_trash(layout, ns_id, recreate=False)
        with store.transaction() as conn:
            drop_unbound(layout, store, ns_id)
            # Its rows go with it, under the lock: a fresh dir an init makes next has its own.
            conn.execute("DELETE FROM pages WHERE namespace_id = ?", (ns_id,))
    if entry is None:
        return base  # no dir: nothing to delete, the registry is in line
    r = drain_entry(
        layout, store, entry, actor=actor, pacer=pacer, progress=tally.offset(),
        audit_as=("evict", step.reason),
    )  # fmt: skip
    tally.add(r)
    return replace(
        base, files=r.files, bytes=r.bytes, vanished=r.vanished, young=r.young, refused=r.refused
    )


def _dir_id(layout: Layout, rel_dir: str) -> tuple[int, int] | None:
    """(device, inode) of <root>/<rel_dir>, None if absent: tells a dir renamed away."""
    try:
        st = os.stat(layout.root / rel_dir, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _bound(store: Store, ns_id: str | None) -> bool:
    row = store.conn.execute("SELECT 1 FROM bindings WHERE namespace_id = ?", (ns_id,)).fetchone()
    return row is not None


def _forget(store: Store, ns_id: str | None, rel_dir: str, names: list[str]) -> None:
    """Drop index rows of files that are gone (trash dirs have none)."""
    if not names or ns_id is None or not rel_dir.startswith("ns/"):
        return
    with store.transaction() as conn:
        conn.executemany(
            "DELETE FROM pages WHERE namespace_id = ? AND name = ?", [(ns_id, n) for n in names]
        )


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
