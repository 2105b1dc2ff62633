"""Carry out a GC plan: delete through cachemgr.fs.deletion, keep the index, audit each step."""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from cachemgr.errors import UnsafePathError
from cachemgr.fs.deletecheck import files_of, reason_of
from cachemgr.fs.deletion import DeleteReport, Pacer, Progress, delete_files, delete_own_temps
from cachemgr.gc.drop import InUse, drop_namespace, kept
from cachemgr.gc.find import step_format
from cachemgr.gc.pagestore import PageId
from cachemgr.gc.plan import GcPlan
from cachemgr.gc.policy import KEEPING
from cachemgr.gc.step import GcReport, GcStep, StepResult
from cachemgr.layout import Layout
from cachemgr.ns.quarantine import is_denied
from cachemgr.ns.trash import drain_entry
from cachemgr.sglang.liveuse import live_users
from cachemgr.state import pages_sql
from cachemgr.state.store import Store

log = logging.getLogger("cachemgr.gc.plan")
# Names per delete call: each chunk's index rows and its audit row are written in one
# transaction once its files are gone, so a kill -9 leaves at most one chunk unaudited.
CHUNK = 256
# (namespace, the step's names, from which on they are not deleted yet) -> names to keep after
# all (asked before each chunk of a step that keeps a limit: a request may have reached a page
# since the plan).
Keep = Callable[[str, Sequence[str], int], Collection[str]]


class InFlight(NamedTuple):
    """What the live daemon knows is in use beyond its chain model, when GC plans."""

    queued: Collection[PageId] = ()  # pages read or stored, not applied to the model yet
    keep: Keep | None = None  # asked before each chunk (None: nothing comes in between)


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

    def add(self, r: DeleteReport | StepResult) -> None:
        self.files += r.files
        self.bytes += r.bytes


def execute_gc(
    plan: GcPlan,
    layout: Layout,
    store: Store,
    *,
    dry_run: bool = False,
    actor: str = "cli",
    pacer: Pacer | None = None,
    progress: Progress | None = None,
    clock: Callable[[], float] = time.time,
    stop: Callable[[], bool] = lambda: False,
    in_use: InUse = live_users,
    keep: Keep | None = None,
) -> GcReport:
    """Run the plan's steps in order; a dry run stats the same files and deletes none.

    `stop()` true (a shutdown) ends the run after the chunk being deleted. `in_use` names the
    running processes whose storage dir a namespace is (none may lose it as unbound). `keep`:
    before each chunk of cap-keeping, the names that must stay after all.
    """
    started = clock()
    tally = _Tally(progress)
    results = []
    for step in plan.steps:
        if stop():
            break
        try:
            result = _run_step(
                step, layout, store, dry_run, actor, pacer, tally, clock, stop, in_use,
                keep if step.reason in KEEPING and step.namespace_id and not step.forced else None,
            )  # fmt: skip
        except UnsafePathError as e:  # its dir became a symlink: the other steps still run
            log.warning("gc step refused", extra={"dir": step.rel_dir, "error": str(e)})
            result = StepResult(step, skipped=f"refused: {e}")
        except OSError as e:  # another user's dir: the other steps still run (the caller
            if not is_denied(e):  # says so once: cachemgr.ns.quarantine)
                raise
            log.debug("gc step denied", extra={"dir": step.rel_dir, "error": str(e)})
            result = StepResult(step, skipped=f"denied: {e.strerror}", denied=str(e))
        results.append(result)
    warnings = plan.warnings + tuple(refusal_warning(r) for r in results if r.refused)
    report = GcReport(dry_run, True, started, clock(), tuple(results), warnings)
    _log_summary(report, actor)
    return report


def refusal_warning(result: StepResult) -> str:
    """One line for the files a step had to keep: how many, why, one example and, when the
    kernel refused (another user's dir without the group's write), the fix."""
    by_reason: dict[str, int] = {}
    for refusal in result.refused:
        by_reason[reason_of(refusal)] = by_reason.get(reason_of(refusal), 0) + files_of(refusal)
    counts = ", ".join(f"{n} {reason}" for reason, n in sorted(by_reason.items()))
    line = (
        f"{sum(by_reason.values())} files in {result.rel_dir} cannot be deleted by uid "
        f"{os.geteuid()} ({counts}), e.g. {result.refused[0]}"
    )
    denied = [str(r) for r in result.refused if reason_of(r) == "permission"]
    if any(_EPERM in r for r in denied):
        line += f"; {EPERM_FIX}"
    if any(_EPERM not in r for r in denied):
        line += f"; {PERMISSION_FIX}"
    return line


# What to do about files the kernel does not let GC delete (see `cachemgr doctor`): EACCES is a
# dir GC's user may not write in; EPERM is refused whoever writes there (root included).
PERMISSION_FIX = (
    "the writer makes dirs the daemon's group cannot write (its umask is 022?): run the engine "
    "with umask 0002 in the daemon's group (docs/deploy.md), then `chmod -R g+w` its dirs"
)
_EPERM = os.strerror(errno.EPERM)
EPERM_FIX = (
    "the file or its dir is immutable or append-only (`lsattr -d`; `chattr -i -a`), or a "
    "sticky dir (mode +t) of another owner (`chmod -t` it)"
)


def _run_step(
    step: GcStep,
    layout: Layout,
    store: Store,
    dry_run: bool,
    actor: str,
    pacer: Pacer | None,
    tally: _Tally,
    clock: Callable[[], float],
    stop: Callable[[], bool],
    in_use: InUse,
    keep: Keep | None,
) -> StepResult:
    base = StepResult(step)
    if step.reason in ("unbound", "ttl") and step.remove_dir and step.namespace_id and not dry_run:
        result = drop_namespace(
            step, base, layout, store, actor, pacer, tally.offset(), clock, in_use
        )
        tally.add(result)
        return result
    why = step.reason in ("unbound", "ttl") and kept(layout, store, step.namespace_id, in_use)
    if why:  # a dry run says what the drop would find under the lock
        return replace(base, skipped=why)
    if step.reason == "trash":  # the same path as a purge's own drain, audited there
        entry = step.rel_dir.removeprefix(".trash/")
        r = drain_entry(
            layout, store, entry, actor=actor, pacer=pacer, progress=tally.offset(),
            dry_run=dry_run,
        )  # fmt: skip
        tally.add(r)
        return base.done(r)
    if step.namespace_id is None and step.reason == "tmp":
        return _sweep_own_temps(step, base, layout, store, dry_run, actor, clock)
    total = DeleteReport(dry_run=dry_run)
    staying: set[str] = set()
    fmt = step_format(layout, step)
    for i in range(0, len(step.names), CHUNK):
        if stop():
            base = replace(base, skipped="stopped: the daemon is shutting down")
            break
        if keep is not None and step.namespace_id is not None:
            staying.update(keep(step.namespace_id, step.names, i))
        chunk = [n for n in step.names[i : i + CHUNK] if n not in staying]
        gone: dict[str, int | None] = {}
        before = _dir_id(layout, step.rel_dir)
        # Unpaced here, paced below once the chunk is recorded: a kill -9 during the pacer's
        # sleep (where a paced run spends its time) then finds audit and index exact.
        try:
            r = delete_files(
                layout.root, step.rel_dir, chunk, dry_run=dry_run,
                min_age=step.min_age, progress=tally.offset(), now=clock,
                removed=gone.__setitem__, fmt=fmt,
            )  # fmt: skip
        except OSError as e:  # an unlink refused: what went before it is recorded all the same
            if not dry_run and _dir_id(layout, step.rel_dir) == before:
                _record_chunk(store, step, list(gone), _freed(gone), actor, clock())
            if not is_denied(e):
                raise
            done = base.done(total + _freed(gone))
            return replace(done, skipped=f"denied: {e.strerror}", denied=str(e))
        tally.add(r)
        total += r
        if before is None or _dir_id(layout, step.rel_dir) != before:
            # A purge renamed the dir away meanwhile: what was unlinked may lie in .trash/
            # and the purge dropped those rows and audited its pages; rows now are the new
            # dir's, so keep them.
            base = replace(base, skipped="the namespace was purged during GC")
            break
        if not dry_run:
            _record_chunk(store, step, list(gone), r, actor, clock())
        _pace(pacer, r.files)
    return base.done(total)


def _freed(gone: dict[str, int | None]) -> DeleteReport:
    """Files and bytes deleted, from what `delete_files` reported gone (vanished: None)."""
    sizes = [b for b in gone.values() if b is not None]
    return DeleteReport(len(sizes), sum(sizes))


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
    # The files are gone: wait out a foreign write lock however long it is held (GC stops
    # here, one chunk ahead), so the index and audit never miss what was deleted.
    with store.transaction(patience=float("inf")) as conn:
        if gone and step.namespace_id is not None and step.rel_dir.startswith("ns/"):
            pages_sql.delete_pages(conn, [(step.namespace_id, n) for n in gone])
        if r.files:
            store.audit(
                "evict", namespace_id=step.namespace_id, reason=step.reason, actor=actor,
                pages=r.files, bytes_=r.bytes, at=at,
            )  # fmt: skip


def _sweep_own_temps(
    step: GcStep,
    base: StepResult,
    layout: Layout,
    store: Store,
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
    return base.done(r)


def _dir_id(layout: Layout, rel_dir: str) -> tuple[int, int] | None:
    """(device, inode) of <root>/<rel_dir>, None if absent: tells a dir renamed away."""
    try:
        st = os.stat(layout.root / rel_dir, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _log_summary(report: GcReport, actor: str) -> None:
    by_reason = {r: {"files": f, "bytes": b} for r, (f, b) in report.totals().items()}
    refused = report.refused_files()
    log.log(
        logging.WARNING if refused else logging.INFO,
        "gc dry run" if report.dry_run else "gc done",
        extra={
            "actor": actor, "files": report.files, "bytes": report.bytes,
            "by_reason": by_reason, "seconds": round(report.finished_at - report.started_at, 3),
            "held": report.held, "refused": refused, "warnings": list(report.warnings),
        },
    )  # fmt: skip
