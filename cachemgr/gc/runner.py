"""GC runs: the daemon's loop and one-off runs.

A cycle with nothing to delete is the cheap check (cachemgr.gc.check): no scan of the pages
or their files. Listing namespace dirs (stale temps) and checking page sizes happen every
sweep_interval. Keeping a cap or the free-space floor is continuous: GC is woken when stores
cross a watermark (or are about to), by the index after a batch or by the watcher before the
index applied them, and a run that freed space is followed at once by the next if the writer
is still ahead.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from cachemgr.errors import CachemgrError, StateCorrupt
from cachemgr.fs import reserve
from cachemgr.fs.deletecheck import REFUSAL_REASONS, RefusalReason, reason_of
from cachemgr.fs.deletion import Pacer, Progress
from cachemgr.fs.leadership import Leadership
from cachemgr.fs.usage import DiskUsageFn
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.check import needs_gc
from cachemgr.gc.drop import InUse
from cachemgr.gc.execute import InFlight, execute_gc
from cachemgr.gc.find import TempFile
from cachemgr.gc.floor import audit_floor, below_floor, free_floor
from cachemgr.gc.plan import Earlier, GcPlan, plan_gc
from cachemgr.gc.policy import KEEPING, GcPolicy, GcReason
from cachemgr.gc.step import GcReport
from cachemgr.layout import Layout
from cachemgr.ns.quarantine import ROOT, Quarantine, is_denied
from cachemgr.sglang.liveuse import live_users
from cachemgr.state.store import Store
from cachemgr.worker import DeathHandler, Worker

log = logging.getLogger("cachemgr.gc.plan")
RUN_GAP = 5.0  # seconds at least between two daemon runs (wakes in between are coalesced)
FLOOR_CHECK = 5.0  # seconds between two statvfs checks of the free-space floor


@dataclass
class GcStats:
    """What the daemon's GC did, for metrics (read without locks: ints, floats, and a dict
    whose keys never change)."""

    ok: int = 0  # runs that planned and executed (ticks with nothing to do are not runs)
    error: int = 0  # cycles or requested runs that failed
    skipped: int = 0  # cycles in which another process led GC
    short: int = 0  # runs that could not delete what a cap or the floor needed (refusals)
    last_success: float = 0.0  # the last cycle or run that ended without error or refusal
    overridden: int = 0  # pages a limit took though a protection (min_age, in flight) held them
    refused: dict[RefusalReason, int] = field(
        default_factory=lambda: dict.fromkeys(REFUSAL_REASONS, 0)
    )  # files runs meant to delete and had to keep, per reason

    def count(self, report: GcReport) -> None:
        """One run that executed: `ok`, or `short` if it held no limit it had to hold."""
        for reason, files in report.refused_files().items():
            self.refused[reason] += files
        if report.held:
            self.ok += 1
            self.last_success = report.finished_at
        else:
            self.short += 1


class GcRunner(Worker):
    """Runs GC for one root: periodically, when woken (a watermark crossed), or on request.

    Give it its own Store: its connection must not be shared with another thread's
    transactions (runs and checks are serialized on it). Only the holder of the root's GC
    leadership deletes. `start()` runs the daemon's loop on a thread (cycles begin once
    `ready` is set: the index is built); `stop()` ends a run after the chunk it is deleting.
    """

    def __init__(
        self,
        layout: Layout,
        store: Store,
        policy: GcPolicy,
        *,
        leadership: Leadership | None = None,
        clock: Callable[[], float] = time.time,
        disk_usage: DiskUsageFn | None = None,
        eligible: Callable[[], bool] = lambda: True,
        in_use: InUse = live_users,
        ready: threading.Event | None = None,
        model: ChainModel | None = None,
        ahead: Callable[[], int] = lambda: 0,
        pending: Callable[[], int] = lambda: 0,
        in_flight: Callable[[], InFlight] = InFlight,
        after_run: Callable[[], None] = lambda: None,
        quarantine: Quarantine | None = None,
        on_death: DeathHandler | None = None,
    ) -> None:
        super().__init__("gc", on_death=on_death)
        # Namespaces whose pages this process may not delete: said once, tried each run.
        self.quarantine = quarantine if quarantine is not None else Quarantine()
        self.model = model  # the index's live chain model (None: built per run from the DB)
        self.ahead = ahead  # bytes the writer adds while GC frees space (the daemon's estimate)
        self.pending = pending  # bytes stored that the index does not count yet
        self.in_flight = in_flight  # what is in use that the model has not seen (at a plan)
        self.after_run = after_run  # after each run that deleted (the room it left changed)
        self.run_seconds = 0.0  # how long the last run that only kept a limit took
        self.ready = ready
        self.store, self.layout, self.policy = store, layout, policy
        self.in_use = in_use  # who uses a namespace dir right now (execute_gc)
        self.leadership = leadership or Leadership(layout.gc_lock)
        self.eligible = eligible  # False: never take the GC lock (another process should)
        self.clock = clock
        # As if the state DB's space reserve were allocated: taking it back keeps the floor.
        self.disk_usage = disk_usage or reserve.usage_with_reserve(layout.state_dir)
        self.last_sweep = float("-inf")
        self.stats = GcStats(last_success=clock())
        self._wake = threading.Event()
        self._busy = threading.Lock()
        self._failing: str | None = None  # what the last cycle failed of, until one succeeds

    @contextmanager
    def _serialized(self) -> Iterator[None]:
        """One check or run at a time on this runner's connection, on the DB now at the path
        (one deleted or moved aside is reopened; one found corrupt raises StateCorrupt)."""
        with self._busy:
            self.store.follow_path()
            with self.store.guard():
                yield

    def needs_gc(self) -> tuple[GcReason, ...]:
        """The cheap check (see the module docstring)."""
        with self._serialized():
            return needs_gc(
                self.layout, self.store, self.policy, now=self.clock(),
                disk_usage=self.disk_usage, ahead=self.ahead(), pending=self.pending(),
            )  # fmt: skip

    def _lead(self) -> bool:
        return self.eligible() and self.leadership.try_acquire()

    def tick(self) -> GcReport | None:
        """One daemon cycle: run GC if a limit is crossed or a sweep is due, else nothing."""
        if not self._lead():
            self.stats.skipped += 1
            return None
        floor = self.free_floor()
        sweep = self.clock() - self.last_sweep >= self.policy.sweep_interval
        try:
            idle = not sweep and not self.needs_gc()
        except BaseException:
            self.stats.error += 1
            raise
        if idle:
            self.stats.last_success = self.clock()
            return floor
        return self.run(actor="auto", sweep=sweep)

    def free_floor(self, actor: str = "auto", policy: GcPolicy | None = None) -> GcReport | None:
        """Below the free-space floor: delete from a scan of the disk first, without the DB
        (cachemgr.gc.floor); None if free space is over the floor or another process leads.
        `policy` replaces the runner's own for this pass (one-off limits)."""
        policy = policy or self.policy
        try:
            if not below_floor(self.layout, policy, self.disk_usage) or not self._lead():
                return None
            with self._busy:
                report = free_floor(
                    self.layout,
                    policy,
                    disk_usage=self.disk_usage,
                    pacer=Pacer(rate=policy.delete_rate),
                    clock=self.clock,
                    stop=self._stopping.is_set,
                )
        except BaseException:
            self.stats.error += 1
            raise
        with self._busy:
            self.stats.count(report)
            self._after_floor(report, actor)
        return report

    def _after_floor(self, report: GcReport, actor: str) -> None:
        """Audit the floor pass if the DB takes writes again; take the reserve back if room."""
        try:
            audit_floor(self.store, report, actor)
        except (sqlite3.Error, OSError) as e:
            if not reserve.is_disk_full(e, self.layout.state_dir):
                raise
            log.warning("floor pass not audited: the state DB's filesystem is still full",
                        extra={"files": report.files, "bytes": report.bytes})  # fmt: skip
        reserve.keep(self.layout.state_dir)

    def run(
        self,
        *,
        dry_run: bool = False,
        actor: str = "auto",
        sweep: bool = True,
        temps: list[TempFile] | None = None,
        pacer: Pacer | None = None,
        progress: Progress | None = None,
        policy: GcPolicy | None = None,
        floor: GcReport | None = None,
    ) -> GcReport:
        """Plan and execute one GC run; a non-leader reports who leads and deletes nothing
        (a dry run plans all the same, and says who leads).

        Below the free-space floor, the floor pass (cachemgr.gc.floor) goes first, and a dry
        run plans it too: the plan after it counts its files as gone, so the dry run lists
        what the real run deletes. `floor`: the pass the caller made already (the CLI, before
        it opened the DB), not made again; either is in the report. Deletion is paced at the
        policy's delete_rate unless a `pacer` is given; `policy` replaces the runner's own for
        this run (one-off limits).
        """
        if not dry_run and not self._lead():
            now = self.clock()
            return GcReport(dry_run, False, now, now, holder=self.leadership.holder())
        if floor is None:
            floor = self._floor_first(dry_run, actor, policy or self.policy)
        # Planned only: the plan counts its files gone. Done: the disk (and a scan) says so.
        after = Earlier()
        if floor is not None and floor.dry_run:
            after = Earlier.of([r.step for r in floor.steps])
        with self._serialized():
            try:
                report = joined(
                    floor, self._run(dry_run, actor, sweep, temps, pacer, progress, policy, after)
                )
            except BaseException:
                self.stats.error += 1
                raise
        if dry_run and not self.leadership.held and self.leadership.led_elsewhere():
            return replace(report, leader=False, holder=self.leadership.holder())
        if not dry_run:
            self.stats.count(report)
            reserve.keep(self.layout.state_dir)
            self._note_denied(report)
            self.after_run()
        return report

    def _floor_first(self, dry_run: bool, actor: str, policy: GcPolicy) -> GcReport | None:
        """The floor pass a run starts with (checked only, in a dry run); None if free space
        is over the floor."""
        if not dry_run:
            return self.free_floor(actor, policy)
        if not below_floor(self.layout, policy, self.disk_usage):
            return None
        return free_floor(
            self.layout, policy, disk_usage=self.disk_usage, clock=self.clock, dry_run=True
        )

    def _note_denied(self, report: GcReport) -> None:
        """Hold aside the namespaces GC may not delete in (a step denied access to its dir, or
        every file it meant to delete refused by the kernel); clear those it deleted in."""
        for r in report.steps:
            ns = r.namespace_id
            if ns is None or not r.rel_dir.startswith("ns/"):
                continue
            refused = [x for x in r.refused if reason_of(x) == "permission"]
            if r.denied is not None:
                self.quarantine.mark(ns, "not-writable", r.denied)
            elif refused and not r.files:
                self.quarantine.mark(ns, "not-writable", refused[0])
            elif r.files:
                self.quarantine.clear(ns, "not-writable")

    def _run(
        self,
        dry_run: bool,
        actor: str,
        sweep: bool,
        temps: list[TempFile] | None,
        pacer: Pacer | None,
        progress: Progress | None,
        policy: GcPolicy | None,
        after: Earlier,
    ) -> GcReport:
        policy = policy or self.policy
        now, t0, flight = self.clock(), time.monotonic(), self.in_flight()
        plan = plan_gc(
            self.layout, self.store, policy, now=now, disk_usage=self.disk_usage,
            temps=temps, sweep=sweep, model=self.model, ahead=self.ahead(), pending=self.pending(),
            busy=flight.queued, after=after,
        )  # fmt: skip
        if sweep and not dry_run:
            self.last_sweep = now
        if not dry_run:
            self.stats.overridden += plan.overridden
        report = execute_gc(
            plan, self.layout, self.store, dry_run=dry_run, actor=actor,
            pacer=pacer or _pacer(plan, policy), progress=progress,
            clock=self.clock, stop=self._stopping.is_set, in_use=self.in_use, keep=flight.keep,
        )  # fmt: skip
        if _keeping(plan) and not dry_run:  # a paced run's minutes are not cap-keeping's
            # The longest recent run, decaying: a quick one must not start the next late.
            self.run_seconds = max(time.monotonic() - t0, self.run_seconds / 2)
        if self.model is not None and not dry_run:
            for step in plan.steps:
                if step.namespace_id is not None and step.reason in KEEPING:
                    ns_dir = str(self.layout.ns_dir(step.namespace_id))
                    self.model.forget_gone(step.namespace_id, ns_dir, step.names)
        return report

    def wake(self) -> None:
        """Ask for a check now (the watcher saw the index grow past a watermark)."""
        self._wake.set()

    def _interrupt(self) -> None:
        self.wake()

    def _loop(self) -> None:
        """The daemon's GC loop: a tick at once (once `ready` is set), then every interval or
        when woken, until stopped."""
        stop, ready = self._stopping, self.ready
        try:
            # The index may take long to build, or fail to for lack of space: the floor,
            # which needs neither it nor the DB, is kept meanwhile.
            while ready is not None and not ready.wait(0.5):
                if stop.is_set():
                    return
                if self._cycle(self.free_floor):
                    stop.wait(RUN_GAP)
            next_tick = time.monotonic()  # a tick at once
            while not stop.is_set():
                wait = min(next_tick - time.monotonic(), FLOOR_CHECK)
                woken = self._wake.wait(max(wait, 0.0))
                self._wake.clear()
                if stop.is_set():
                    break
                if woken or time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + self.policy.interval
                    stuck = self._cycle(self.tick)
                else:
                    # Anything may fill the filesystem, not only pages the watcher sees (a
                    # writer outside the cache, files SGLang wrote in place): one statvfs.
                    stuck = self._cycle(self.free_floor)
                if stuck:
                    # A cap not met (pages younger than min_age, or in flight): one run per gap,
                    # not one per batch of events; one after it, woken or not (they age alone).
                    stop.wait(min(self.policy.interval, RUN_GAP))
                    next_tick = min(next_tick, time.monotonic())
        finally:
            self.leadership.release()

    def _cycle(self, run: Callable[[], GcReport | None]) -> bool:
        """One daemon cycle; True if it ran GC, freed nothing and a limit is still crossed, or
        failed: pause before the next. (A run with nothing to free, such as the sweep at
        start-up, is no reason to ignore the wakes of a writer that crosses a watermark next.)"""
        try:
            report = run()
            stuck = report is not None and report.files == 0 and bool(self.needs_gc())
        except StateCorrupt as e:  # moved aside; the indexer rebuilds, the next cycle runs
            log.warning("gc cycle stopped", extra={"error": str(e)})
            return True
        except OSError as e:
            if is_denied(e) and not self._root_usable():
                self.quarantine.mark(ROOT, "unreadable", e)  # said once; the index clears it
            else:
                self._failed(e)  # (a vanished dir, a full disk, a read-only root)
            return True
        except (CachemgrError, sqlite3.Error) as e:
            # One failed cycle (a DB locked by another process, a full disk) must not end GC.
            self._failed(e)
            return True
        if self._failing is not None:
            log.info("gc cycle succeeded again", extra={"after": self._failing})
            self._failing = None
        return stuck

    def _failed(self, error: Exception) -> None:
        """One line when cycles start failing of something new, not a traceback each cycle
        (a read-only root fails every 5 s the same way); the traceback at debug level."""
        kind = type(error).__name__
        what = f"{kind} errno {error.errno}" if isinstance(error, OSError) else f"{kind}: {error}"
        if what != self._failing:
            self._failing = what
            log.warning(
                "gc cycle failed; said again only when the failure changes",
                extra={"error": str(error), "kind": kind},
            )
        log.debug("gc cycle failed", exc_info=True)

    def _root_usable(self) -> bool:
        """Whether this process may still list ns/ and the state dir."""
        dirs = (self.layout.ns_root, self.layout.state_dir)
        return all(os.access(d, os.R_OK | os.X_OK) for d in dirs)


def _pacer(plan: GcPlan, policy: GcPolicy) -> Pacer:
    """Keeping a cap or the floor keeps up with the writer: unpaced. Mass work (trash,
    unbound namespaces, retention) goes at delete_rate, so the disk stays responsive."""
    if _keeping(plan):
        return Pacer(rate=None)
    return Pacer(rate=policy.delete_rate)


def joined(floor: GcReport | None, report: GcReport) -> GcReport:
    """One report for a floor pass and the run after it."""
    if floor is None:
        return report
    return replace(
        report,
        started_at=floor.started_at,
        steps=floor.steps + report.steps,
        warnings=tuple(dict.fromkeys(floor.warnings + report.warnings)),  # each said once
    )


def _keeping(plan: GcPlan) -> bool:
    """Whether the plan only keeps a cap or the free-space floor (unpaced: see _pacer)."""
    return all(s.reason in KEEPING for s in plan.steps)
