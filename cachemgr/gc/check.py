"""The cheap "anything to do?" check GC makes before planning: a few aggregate rows (kept by
triggers on the page index), one statvfs and a listing of .trash/."""

from __future__ import annotations

import contextlib
import shutil
import sqlite3

from cachemgr.errors import StateLocked, UnsafePathError
from cachemgr.fs.usage import DiskUsage, DiskUsageFn
from cachemgr.gc import find as gcfind
from cachemgr.gc.plan import Earlier, file_counts
from cachemgr.gc.policy import (
    GcPolicy,
    GcReason,
    headroom,
    namespace_file_limits,
    over_file_limits,
    over_limits,
)
from cachemgr.layout import Layout
from cachemgr.ns import registry as nsreg
from cachemgr.ns.trash import list_trash
from cachemgr.state import busy, pages_sql
from cachemgr.state.store import BUSY_TIMEOUT, Store


def needs_gc(
    layout: Layout,
    store: Store,
    policy: GcPolicy,
    *,
    now: float,
    disk_usage: DiskUsageFn = shutil.disk_usage,
    ahead: int = 0,
    pending: int = 0,
) -> tuple[GcReason, ...]:
    """Why GC should run now (empty: it need not), from aggregates and statvfs only;
    `pending`, `ahead`: bytes stored but not indexed yet, and about to be written
    (cachemgr.gc.policy.over_limits)."""
    reasons: list[GcReason] = []
    with contextlib.suppress(UnsafePathError):  # a symlinked .trash/ is GC's to report
        if list_trash(layout):
            reasons.append("trash")
    conn = store.conn
    dropped = gcfind.unbound_past_retention(conn, policy, now)
    if dropped:  # rare (GC drops them at once), unless damaged: those are left alone
        damaged = nsreg.damaged(layout)
        dropped = [d for d in dropped if d[0] not in damaged]
    reasons += sorted({r for _, r in dropped})
    gone = {ns for ns, _ in dropped}
    usage = {ns: b for ns, b in pages_sql.namespace_bytes(conn).items() if ns not in gone}
    disk = DiskUsage(*disk_usage(layout.root))
    files = file_counts(conn, layout, usage, Earlier(), gone=gone)
    files = files.with_writer(ahead + pending, usage)
    limits = over_limits(policy, usage, disk, ahead=ahead, pending=pending, files=files)
    if limits.namespaces:
        reasons.append("cap")
    if limits.root is not None and limits.budget.reason not in reasons:
        reasons.append(limits.budget.reason)
    reasons += sorted({r for _, r in limits.namespace_files.values()} - set(reasons))
    if limits.root_files is not None and limits.files_budget.reason not in reasons:
        reasons.append(limits.files_budget.reason)
    return tuple(reasons)


def index_current(pending: int) -> int:
    """`pending` (bytes stored that the index has not applied), or StateLocked if another
    process has held the state DB's write lock longer than a write waits while any are: the
    index the check reads then lags the disk, and it found no limit crossed (a cap of 300
    pages went to 2,600 during a 30 s lock), a success each tick. Failing, the daemon's cycle
    says so (one log line naming the holder, cachemgr_gc_runs_total; last_success stays, so
    CachemgrGCFailing fires); GC could delete nothing it can record anyway. The floor is kept
    by its pass, which needs no DB."""
    holder = busy.LOCKS.held_elsewhere(BUSY_TIMEOUT)
    if holder is not None and pending > 0:
        raise StateLocked(
            f"GC cannot hold the caps: the state DB is write-locked by {holder}, and the "
            "index lags the pages stored since; GC checks again once it is free"
        )
    return pending


def room(
    layout: Layout,
    conn: sqlite3.Connection,
    policy: GcPolicy,
    *,
    disk_usage: DiskUsageFn = shutil.disk_usage,
    ahead: int = 0,
) -> float:
    """Bytes the writer may still store before the root's budget passes its high watermark,
    by the index (cachemgr.gc.policy.headroom)."""
    used = sum(pages_sql.namespace_bytes(conn).values())
    return headroom(policy, used, DiskUsage(*disk_usage(layout.root)), ahead=ahead)


def file_room(layout: Layout, conn: sqlite3.Connection, policy: GcPolicy) -> float:
    """Page files the writer may still store before a file cap or the inode floor passes its
    high watermark, by the index (math.inf without such a limit): the least over the root and
    each namespace, since the watcher does not tell which one a store goes to."""
    files = file_counts(conn, layout, pages_sql.namespace_bytes(conn), Earlier())
    high = policy.high_watermark
    _, budget, _ = over_file_limits(policy, files)
    rooms = [budget.limit * high - sum(files.live.values())]
    for ns, n in files.live.items():
        rooms += [
            cap * high - counted for cap, _, counted in namespace_file_limits(policy, files, ns, n)
        ]
    return max(0.0, min(rooms))
