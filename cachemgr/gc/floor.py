"""GC's free-space floor without the state DB: plan from a scan of the disk, delete oldest first.

On a full filesystem SQLite may be unable to open or write the DB (its -shm and -wal need new
blocks) and the index may not be built yet; deleting needs no space. So when free space is
below the floor, this pass runs first: it lists .trash/ and every namespace dir, and deletes
trash leftovers, then pages by mtime, oldest first (SGLang never rewrites a page, so its mtime
is when it was stored), through cachemgr.fs.deletion with the usual min-age rule, until the root's
free-space budget is back under its low watermark. It writes nothing: the caller audits the
result when the DB takes writes again, and the index catches up through the watcher or a scan.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import replace

from cachemgr.errors import StateError, UnsafePathError
from cachemgr.fs import reserve
from cachemgr.fs.deletion import DeleteReport, Pacer, delete_dir, delete_files
from cachemgr.fs.leadership import Leadership
from cachemgr.fs.usage import DiskUsage, DiskUsageFn
from cachemgr.gc import find as gcfind
from cachemgr.gc.policy import GcPolicy, root_budget
from cachemgr.gc.step import GcReport, GcStep, StepResult
from cachemgr.layout import Layout
from cachemgr.state.index import namespace_dirs
from cachemgr.state.store import Store

log = logging.getLogger("cachemgr.gc.plan")


def below_floor(layout: Layout, policy: GcPolicy, disk_usage: DiskUsageFn) -> bool:
    """Whether the root's filesystem has less free space than the policy's floor."""
    disk = DiskUsage(*disk_usage(layout.root))
    floor = policy.floor(disk)
    return floor > 0 and disk.free < floor


def plan_floor(
    layout: Layout, policy: GcPolicy, *, now: float, disk_usage: DiskUsageFn
) -> tuple[list[GcStep], list[str]]:
    """Steps that bring free space back over the floor, from a listing of the disk alone."""
    warnings: list[str] = []
    steps = gcfind.trash_leftovers(layout, warnings)
    pages: list[tuple[float, str, str, int]] = []  # (mtime, ns, name, size)
    alone = gcfind.left_alone(layout, warnings)
    for ns in namespace_dirs(layout):
        if ns in alone:
            continue
        try:
            found, _ = gcfind.list_namespace(layout, ns)
        except UnsafePathError as e:
            warnings.append(f"ns/{ns} not listed: {e}")
            continue
        pages += [(mtime, ns, name, size) for name, (size, mtime) in found.items()]
    used = sum(p[3] for p in pages)
    disk = DiskUsage(*disk_usage(layout.root))
    # The floor alone: a byte cap is the regular run's business, with the index's LRU order.
    budget = root_budget(replace(policy, max_bytes=None), used + sum(s.bytes for s in steps), disk)
    need = budget.excess(used, policy.low_watermark) if budget.reason == "free_space" else 0
    chosen: dict[str, list[tuple[str, int]]] = {}
    for mtime, ns, name, size in sorted(pages):
        if need <= 0 or now - mtime < policy.min_age:
            break
        chosen.setdefault(ns, []).append((name, size))
        need -= size
    if need > 0:
        warnings.append(f"free_space: {need} bytes short of the floor's low watermark")
    for ns, picked in chosen.items():
        names = tuple(n for n, _ in picked)
        size = sum(s for _, s in picked)
        steps.append(GcStep("free_space", f"ns/{ns}", ns, names, size, policy.min_age))
    return steps, warnings


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
    steps, warnings = plan_floor(layout, policy, now=started, disk_usage=disk_usage)
    results = []
    for step in steps:
        if stop():
            break
        results.append(StepResult(step).done(_delete(layout, step, pacer, clock, dry_run)))
    report = GcReport(dry_run, True, started, clock(), tuple(results), tuple(warnings))
    seconds = round(report.finished_at - started, 3)
    log.warning(
        f"free space {'is' if dry_run else 'was'} below the floor; "
        f"{'would delete' if dry_run else 'deleted'} from a scan of the disk",
        extra={"files": report.files, "bytes": report.bytes, "seconds": seconds},
    )
    return report


def _delete(
    layout: Layout, step: GcStep, pacer: Pacer | None, clock: Callable[[], float], dry_run: bool
) -> DeleteReport:
    """Carry out one floor step (a dry run: check its files only)."""
    try:
        fmt = gcfind.step_format(layout, step)
        if step.remove_dir:
            return delete_dir(layout.root, step.rel_dir, pacer=pacer, fmt=fmt, dry_run=dry_run)
        return delete_files(
            layout.root,
            step.rel_dir,
            step.names,
            min_age=step.min_age,
            pacer=pacer,
            now=clock,
            fmt=fmt,
            dry_run=dry_run,
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
        leadership = Leadership(layout.gc_lock)
        if not leadership.try_acquire():
            raise
    try:
        report = free_floor(layout, policy, disk_usage=reserve.usage_with_reserve(layout.state_dir))
    finally:
        leadership.release()
    store = Store.open(layout.db_path, check=check)
    audit_floor(store, report, actor)
    return store


def audit_floor(store: Store, report: GcReport, actor: str) -> None:
    """Record a floor pass in the audit table, one row per reason (as execute_gc's steps do)."""
    with store.transaction():
        for reason, (files, size) in report.totals().items():
            if files or size:
                action = "delete-trash" if reason == "trash" else "evict"
                store.audit(
                    action, namespace_id=None, reason=reason, actor=actor, pages=files,
                    bytes_=size, at=report.finished_at,
                )  # fmt: skip
