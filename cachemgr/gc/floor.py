"""GC's free-space floor without the state DB: plan from a scan of the disk, delete oldest first.

On a full filesystem SQLite may be unable to open or write the DB (its -shm and -wal need new
blocks) and the index may not be built yet; deleting needs no space. So when free space is
below the floor, this pass runs first: it lists .trash/ and every namespace dir, and deletes
trash leftovers (until the floor is met), then pages by mtime, oldest first (SGLang never
rewrites a page, so its mtime is when it was stored), through cachemgr.fs.deletion with the
usual min-age rule, until the root's free-space budget is back under its low watermark. It
writes nothing: the caller audits the result when the DB takes writes again, and drops the
index rows of the pages it deleted in the same transaction (as GC's own chunks do): the
regular plan that follows in the same run must not count them again, or it evicts for a cap
what the pass deleted already.

It does not hold a flat dir's entry limit (dir_full): a full dir index refuses new names in
that one dir while bytes and inodes are free, so it never puts the root below the floor nor
keeps the DB (in another dir) from opening; the regular plan after the pass holds it.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import time
from collections.abc import Callable
from dataclasses import replace

from cachemgr.errors import StateError, UnsafePathError
from cachemgr.fs import reserve
from cachemgr.fs.deletion import DeleteReport, Listeners, Pacer, delete_dir, delete_files
from cachemgr.fs.leadership import gc_leadership
from cachemgr.fs.safe import open_dir
from cachemgr.fs.usage import DiskUsage, DiskUsageFn, inode_usage
from cachemgr.gc import find as gcfind
from cachemgr.gc.execute import refusal_warning
from cachemgr.gc.held import AuditRow, HeldAudits
from cachemgr.gc.policy import (
    Budget,
    Files,
    GcPolicy,
    GcReason,
    Inodes,
    over_file_limits,
    root_budget,
)
from cachemgr.gc.step import (
    HARD_LINKS,
    GcReport,
    GcStep,
    StepResult,
    Unmet,
    linked_verdict,
    short_of,
)
from cachemgr.layout import Layout
from cachemgr.state import pages_sql
from cachemgr.state.index import namespace_dirs
from cachemgr.state.store import Store

log = logging.getLogger(__name__)


def below_floor(layout: Layout, policy: GcPolicy, disk_usage: DiskUsageFn) -> bool:
    """Whether the root's filesystem has less free space than the policy's floor, or fewer
    free inodes than its inode floor."""
    disk = DiskUsage(*disk_usage(layout.root))
    floor = policy.floor(disk)
    return (floor > 0 and disk.free < floor) or below_inode_floor(layout, policy)


def below_inode_floor(layout: Layout, policy: GcPolicy) -> bool:
    """Whether the root's filesystem has fewer free inodes than the policy's inode floor (a
    filesystem without an inode table, total 0, has none)."""
    inodes = Inodes(*inode_usage(layout.root))
    floor = policy.inode_floor(inodes)
    return floor > 0 and inodes.free < floor


def _inode_budget(layout: Layout, policy: GcPolicy, files: int) -> Budget | None:
    """The root's file budget under the inode floor alone, None when free inodes are over it.
    A file cap is the regular run's business, in the index's order and under its own reason
    (with it, this pass took its whole excess by mtime)."""
    if not below_inode_floor(layout, policy):
        return None
    inodes = Inodes(*inode_usage(layout.root))
    floor_only = replace(policy, max_files=None)
    budget = over_file_limits(floor_only, Files({"": files}, inodes=inodes))[1]
    return budget if budget.reason == "free_inodes" else None


def _floors_unmet(
    policy: GcPolicy,
    space: Budget | None,
    inodes: Budget | None,
    left: tuple[int, int],
    linked: int,
) -> tuple[Unmet, ...]:
    """The floors still over their high watermark with `left` (bytes, files) of the pages
    that free space once the pass is done, as a regular run's plan says them (cachemgr.gc.plan):
    what would still have to go, of the cache or beside it. `linked`: the pages another hard
    link keeps, which the pass leaves (their deletion would free nothing)."""
    high, low = policy.high_watermark, policy.low_watermark
    cause = None
    if linked:
        cause = f"GC has nothing else it may delete that frees any: {linked:,} pages are "
        cause += HARD_LINKS
    out = []
    if space is not None and space.over(left[0], high):
        out.append(Unmet("free_space", None, "bytes", space.shortfall(left[0], low), cause))
    if inodes is not None and inodes.over(left[1], high):
        out.append(Unmet("free_inodes", None, "files", inodes.shortfall(left[1], low), cause))
    return tuple(out)


def plan_floor(
    layout: Layout, policy: GcPolicy, *, now: float, disk_usage: DiskUsageFn
) -> tuple[list[GcStep], list[str]]:
    """Steps that bring free space back over the floor, from a listing of the disk alone."""
    steps, warnings, _ = _plan_floor(layout, policy, now=now, disk_usage=disk_usage)
    return steps, warnings


def _plan_floor(
    layout: Layout, policy: GcPolicy, *, now: float, disk_usage: DiskUsageFn
) -> tuple[list[GcStep], list[str], tuple[Unmet, ...]]:
    """plan_floor, and the floors its steps leave unmet: what would still have to go (the
    pass's report is not `held` then: cachemgr_gc_limits_unmet said so while its log line
    said held)."""
    warnings: list[str] = []
    steps = gcfind.trash_leftovers(layout, warnings)
    pages: list[tuple[float, str, str, int]] = []  # (mtime, ns, name, size)
    # Pages another hard link keeps: deleting one frees neither its bytes nor its inode, so
    # they do not count as the cache's here and none goes (the floor is all this pass holds).
    linked = 0
    alone = gcfind.left_alone(layout, warnings)
    for ns in namespace_dirs(layout):
        if ns in alone:
            continue
        try:
            found, _ = gcfind.list_namespace(layout, ns)
        except UnsafePathError as e:
            warnings.append(f"ns/{ns} not listed: {e}")
            continue
        pages += [(f.mtime, ns, name, f.size) for name, f in found.items() if f.links == 1]
        linked += sum(f.links > 1 for f in found.values())
    used = sum(p[3] for p in pages)
    disk = DiskUsage(*disk_usage(layout.root))
    # The floor alone: a byte cap is the regular run's business, with the index's LRU order.
    budget = root_budget(replace(policy, max_bytes=None), used + sum(s.bytes for s in steps), disk)
    need = budget.excess(used, policy.low_watermark) if budget.reason == "free_space" else 0
    files_budget = _inode_budget(layout, policy, len(pages))
    need_files = files_budget.excess(len(pages), policy.low_watermark) if files_budget else 0
    freed = [0, 0]  # bytes, files
    chosen: dict[tuple[GcReason, str], list[tuple[str, int]]] = {}
    for mtime, ns, name, size in sorted(pages):
        if (need <= 0 and need_files <= 0) or now - mtime < policy.min_age:
            break
        reason: GcReason = "free_space" if need > 0 else "free_inodes"
        chosen.setdefault((reason, ns), []).append((name, size))
        need -= size
        need_files -= 1
        freed[0], freed[1] = freed[0] + size, freed[1] + 1
    if need > 0:
        warnings.append(f"{short_of('free_space')}{need} bytes")
    if need_files > 0:
        warnings.append(f"{short_of('free_inodes')}{need_files} files")
    space = budget if budget.reason == "free_space" else None
    left = (used - freed[0], len(pages) - freed[1])
    unmet = _floors_unmet(policy, space, files_budget, left, linked)
    warnings += [u.line() for u in unmet]
    for (reason, ns), picked in chosen.items():
        names = tuple(n for n, _ in picked)
        size = sum(s for _, s in picked)
        steps.append(GcStep(reason, f"ns/{ns}", ns, names, size, policy.min_age))
    return steps, warnings, unmet


def free_floor(
    layout: Layout,
    policy: GcPolicy,
    *,
    disk_usage: DiskUsageFn = shutil.disk_usage,
    pacer: Pacer | None = None,
    clock: Callable[[], float] = time.time,
    stop: Callable[[], bool] = lambda: False,
    dry_run: bool = False,
) -> GcReport:
    """Plan from a scan and delete (see the module doc); no DB is read or written. A dry run
    checks the same files and deletes none."""
    started = clock()
    steps, warnings, unmet = _plan_floor(layout, policy, now=started, disk_usage=disk_usage)
    results = []

    def met() -> bool:
        """A trash entry goes only while the floor is not met: a purge of 9M files is 75
        minutes at delete_rate, and no cap is kept meanwhile (GC's runs drain the rest behind
        their limits)."""
        return stop() or (not dry_run and not below_floor(layout, policy, disk_usage))

    for step in steps:
        if stop():
            break
        until = met if step.reason == "trash" else stop
        done = _delete(layout, step, Listeners(pacer, stop=until), clock, dry_run)
        results.append(StepResult(step).done(done))
    # Files kept are said as a regular run says them: with 0 inodes or bytes left, this pass
    # may be all a run does (the DB does not open until it frees some).
    warnings += [refusal_warning(r) for r in results if r.refused]
    # A page linked again since the scan freed nothing either: the floor still needs its bytes.
    unmet, said = linked_verdict(results, unmet, tuple(warnings))
    report = GcReport(dry_run, True, started, clock(), tuple(results), said, unmet=unmet)
    seconds = round(report.finished_at - started, 3)
    floors = [r.replace("_", " ") for r in ("free_space", "free_inodes") if r in report.totals()]
    log.warning(
        f"{'would delete' if dry_run else 'deleted'} from a scan of the disk: "
        f"{' and '.join(floors) or 'free space or inodes'} below the floor",
        extra={
            **_deleted(report),
            "seconds": seconds,
            "held": report.held,
            "refused": report.refused_files(),
            "warnings": list(report.warnings),
        },
    )
    return report


def _deleted(report: GcReport) -> dict[str, object]:
    """What a pass deleted, as its log lines say it: files, bytes, namespaces."""
    namespaces = sorted({r.namespace_id for r in report.steps if r.files and r.namespace_id})
    return {"files": report.files, "bytes": report.bytes, "namespaces": namespaces}


def floor_pass(
    layout: Layout,
    policy: GcPolicy,
    *,
    disk_usage: DiskUsageFn,
    pacer: Pacer | None = None,
    clock: Callable[[], float] = time.time,
    stop: Callable[[], bool] = lambda: False,
    dry_run: bool = False,
    gate: Callable[[], bool] = lambda: True,
) -> GcReport | None:
    """The pass GC's runner and the CLI make before anything needs the DB: None if free space
    is over the floor or `gate()` is false (the runner does not lead GC; the CLI's user says
    no), else free_floor's report. Record it with `record_floor` once the DB is open."""
    if not below_floor(layout, policy, disk_usage) or not gate():
        return None
    return free_floor(
        layout,
        policy,
        disk_usage=disk_usage,
        pacer=pacer,
        clock=clock,
        stop=stop,
        dry_run=dry_run,
    )


def record_floor(
    layout: Layout, store: Store, report: GcReport, actor: str, held: HeldAudits
) -> None:
    """Audit a floor pass, after the rows `held` from earlier ones; then take the DB's space
    reserve back if there is room. A DB that takes no write (its dir unusable, its filesystem
    still full, its lock held elsewhere) does not lose the pass: its rows are held for the next
    write that succeeds (cachemgr.gc.held) and it is said now; the error is raised again, but
    for a full disk (GC goes on: it frees space)."""
    try:
        audit_floor(layout, store, report, actor, held)
    except (sqlite3.Error, OSError, StateError) as e:
        rows = floor_rows(report, actor)
        if rows:  # (a pass that deleted nothing has nothing to hold, nor to say)
            held.hold(rows)
            log.warning(
                "floor pass not audited yet: the state DB takes no writes; held until it does",
                extra={**_deleted(report), "held_rows": len(held), "error": str(e)},
            )
        if not reserve.is_disk_full(e, layout.state_dir):
            raise
    reserve.keep(layout.state_dir)


def _delete(
    layout: Layout,
    step: GcStep,
    listeners: Listeners,
    clock: Callable[[], float],
    dry_run: bool,
) -> DeleteReport:
    """Carry out one floor step (a dry run: check its files only); `listeners.stop` is asked
    before each part of it, as GC's stop before each chunk."""
    try:
        fmt = gcfind.step_format(layout, step)
        if step.remove_dir:
            return delete_dir(
                layout.root, step.rel_dir, fmt=fmt, dry_run=dry_run, listeners=listeners
            )
        return delete_files(
            layout.root,
            step.rel_dir,
            step.names,
            min_age=step.min_age,
            now=clock,
            fmt=fmt,
            dry_run=dry_run,
            listeners=listeners,
        )
    except (UnsafePathError, FileNotFoundError) as e:
        return DeleteReport(refused=(f"{step.rel_dir}: {e}",), dry_run=dry_run)


def open_freeing(layout: Layout, policy: GcPolicy, actor: str, *, check: bool = False) -> Store:
    """Open the state DB; if its filesystem is too full even for that (no reserve left), free
    space from a scan first, under the root's GC lock (another leader: the error stands)."""
    try:
        return Store.open(layout.db_path, check=check)
    except StateError as e:
        if not reserve.is_disk_full(e, layout.state_dir):
            raise
        leadership = gc_leadership(layout)
        if not leadership.try_acquire():
            raise
    try:
        report = free_floor(layout, policy, disk_usage=reserve.usage_with_reserve(layout.state_dir))
        store, young = open_or_take_young(layout, policy, report, check=check)
    finally:
        leadership.release()
    for done in (report, young):
        if done is not None:
            audit_floor(layout, store, done, actor)
    return store


def open_or_take_young(
    layout: Layout, policy: GcPolicy, report: GcReport, *, check: bool = False
) -> tuple[Store, GcReport | None]:
    """Open the state DB after the floor pass `report`; if its filesystem is still too full
    for that because the pass kept pages younger than min_age, take those too and open it:
    the min-age rule yields to a floor, as in a regular run, which cannot run without the DB
    (with 0 inodes left and every page young, the daemon exited at every start and `cachemgr
    gc` failed, naming itself as the fix). The second pass's report, if one was made."""
    try:
        return Store.open(layout.db_path, check=check), None
    except StateError as e:
        if report.held or policy.min_age <= 0 or not reserve.is_disk_full(e, layout.state_dir):
            raise
    log.warning(
        "the state DB cannot open and the floor pass kept pages younger than gc_min_age: "
        "deleting those too",
        extra={"min_age": policy.min_age},
    )
    usage = reserve.usage_with_reserve(layout.state_dir)
    young = free_floor(layout, replace(policy, min_age=0.0), disk_usage=usage)
    return Store.open(layout.db_path, check=check), young


def gone_pages(layout: Layout, report: GcReport) -> list[tuple[str, str]]:
    """(namespace, name) of the pass's page files that are no longer on disk."""
    gone: list[tuple[str, str]] = []
    for r in report.steps:
        s = r.step
        if s.namespace_id is None or s.remove_dir or not s.rel_dir.startswith("ns/"):
            continue
        try:
            with open_dir(layout.root, s.rel_dir) as fd:
                gone += [(s.namespace_id, n) for n in s.names if not _exists(fd, n)]
        except (OSError, UnsafePathError):
            continue  # the dir itself is gone or unsafe: a scan of the index settles it
    return gone


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def audit_floor(
    layout: Layout, store: Store, report: GcReport, actor: str, held: HeldAudits | None = None
) -> None:
    """Record a floor pass in the audit table, one row per reason (as execute_gc's steps do),
    after the rows `held` from passes the DB could not take, and drop the index rows of the
    pages it deleted, in one transaction."""
    gone = [] if report.dry_run else gone_pages(layout, report)
    earlier = held.pending() if held is not None else ()
    with store.transaction() as conn:
        pages_sql.delete_pages(conn, gone)
        for row in (*earlier, *floor_rows(report, actor)):
            row.write(store)
    if held is not None:
        held.written(earlier)


def floor_rows(report: GcReport, actor: str) -> tuple[AuditRow, ...]:
    """A floor pass's audit rows: one per reason that deleted anything."""
    return tuple(
        AuditRow(
            "delete-trash" if reason == "trash" else "evict",
            reason,
            actor,
            files,
            size,
            report.finished_at,
        )
        for reason, (files, size) in report.totals().items()
        if files or size
    )
