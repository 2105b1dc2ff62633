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
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from cachemgr.errors import CachemgrError, StateCorrupt, StateError, StateLocked
from cachemgr.fs import reserve
from cachemgr.fs.deletecheck import REFUSAL_REASONS, RefusalReason, reason_of
from cachemgr.fs.deletion import Pacer, Progress
from cachemgr.fs.leadership import Leadership, gc_leadership
from cachemgr.fs.usage import DiskUsageFn
from cachemgr.gc.behind import GiveWay
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.check import index_current, needs_gc
from cachemgr.gc.execute import InFlight, Unlinking, execute_gc
from cachemgr.gc.find import TrashCounts
from cachemgr.gc.floor import floor_pass, record_floor
from cachemgr.gc.held import HeldAudits
from cachemgr.gc.pagestore import PageId
from cachemgr.gc.plan import Earlier, GcPlan, Live, plan_gc, unrecorded_unmet
from cachemgr.gc.policy import HOLDING, GcPolicy, GcReason
from cachemgr.gc.sightings import TempSightings
from cachemgr.gc.step import GcReport, Unmet, joined
from cachemgr.gc.told import Applied, forgetting
from cachemgr.layout import Layout
from cachemgr.ns.bindings import catch_up
from cachemgr.ns.liveuse import live_users
from cachemgr.ns.quarantine import Quarantine, denied_key, is_denied
from cachemgr.ns.runcontext import RunContext, unheeded
from cachemgr.state.store import Store
from cachemgr.worker import DeathHandler, Worker

log = logging.getLogger(__name__)
RUN_GAP = 5.0  # seconds at least between two daemon runs (wakes in between are coalesced)
FLOOR_CHECK = 5.0  # seconds between two statvfs checks of the free-space floor


class GcLocked(StateLocked):
    """A run stopped by another's write lock on the state DB; `report` says what it deleted
    before it stopped (all of it recorded)."""

    def __init__(self, message: str, report: GcReport) -> None:
        super().__init__(message)
        self.report = report


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
    # Limits the last planned run left over their high watermark, per reason (a floor pass
    # between runs plans nothing and changes nothing here).
    unmet: tuple[Unmet, ...] = ()

    def count(self, report: GcReport) -> None:
        """One run that executed: `ok`, `short` if it held no limit it had to hold, or `error`
        if another's write lock on the state DB stopped it (it then raises StateLocked)."""
        for reason, files in report.refused_files().items():
            self.refused[reason] += files
        if report.locked_by is not None:
            self.error += 1
        elif report.held:
            self.ok += 1
            self.last_success = report.finished_at
        else:
            self.short += 1


class LiveState:
    """What GC reads of the process it runs in (uvicorn's `ServerState`): this class is a
    one-off run's; the daemon's (cachemgr.daemon.gcstate) reads its index and its watcher."""

    def __init__(
        self,
        *,
        model: ChainModel | None = None,
        ready: threading.Event | None = None,
        quarantine: Quarantine | None = None,
    ) -> None:
        self.model = model  # the index's live chain model (None: built per run from the DB)
        self.ready = ready  # set once the index is built: the loop's cycles wait for it
        # Namespaces whose pages this process may not delete: said once, tried each run.
        self.quarantine = quarantine if quarantine is not None else Quarantine()
        self.woken = threading.Event()  # set: a check is wanted now (a watermark crossed)

    def may_lead(self) -> bool:
        """False: never take the GC lock (another process should)."""
        return True

    def keys_in_memory(self) -> int:
        """Page keys the live model holds in memory, its key file refusing them (0: none, or
        no live model); without the model's lock."""
        return self.model.keys_in_memory if self.model is not None else 0

    def ahead(self, run_seconds: float) -> int:
        """Bytes the writer adds while a run of `run_seconds` frees space (an estimate)."""
        return 0

    def pending(self) -> int:
        """Bytes stored that the index does not count yet."""
        return 0

    def in_flight(self) -> InFlight:
        """What requests use now that the chain model has not seen (taken at each plan)."""
        return InFlight()

    def gone_early(self, pages: Iterable[PageId]) -> None:
        """A run deleted these stores before the index applied them: no longer pending."""

    def unlinking(self) -> Unlinking | None:
        """Whom a run holding a limit tells of each chunk it unlinks (None: nobody)."""
        return None

    def users(self, ns_dir: Path) -> list[int]:
        """The pids using a namespace dir as their storage dir (none may lose it as unbound)."""
        return live_users(ns_dir)

    def after_run(self, runner: GcRunner) -> None:
        """After each run that deleted: the room it left changed."""


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
        live: LiveState | None = None,
        leadership: Leadership | None = None,
        clock: Callable[[], float] = time.time,
        disk_usage: DiskUsageFn | None = None,
        on_death: DeathHandler | None = None,
    ) -> None:
        super().__init__("gc", on_death=on_death)
        self.live = live if live is not None else LiveState()
        self.quarantine = self.live.quarantine
        self.run_seconds = 0.0  # how long the last run that only held a limit took
        self.store = store
        self.layout = layout
        self.policy = policy
        self.leadership = leadership or gc_leadership(layout)
        self.clock = clock
        # As if the state DB's space reserve were allocated: taking it back keeps the floor.
        self.disk_usage = disk_usage or reserve.usage_with_reserve(layout.state_dir)
        self.last_sweep = float("-inf")
        self._sweep_put_off = False  # a due sweep waited for a crossed limit's run (tick)
        self.stats = GcStats(last_success=clock())
        self._busy = threading.Lock()
        # Clear while a run that holds a cap or the floor deletes: the index writer waits for
        # it before each batch (cachemgr.daemon.indexer), as both share one GIL and the run
        # needs no index (it takes the stores the index has not applied too).
        self.not_holding = threading.Event()
        self.not_holding.set()
        self._failing: str | None = None  # what the last cycle failed of, until one succeeds
        # Floor passes' audit rows the DB took no write of (cachemgr.gc.held): written with the
        # next pass, or at the next floor check once it takes writes.
        self.held = HeldAudits()
        self.give_way = GiveWay(self.live.woken)
        self.trash = TrashCounts()  # each trash entry scanned once, then less what runs drain
        self.temps = TempSightings() if layout.node is not None else None  # a fleet's: gc.sightings

    @contextmanager
    def _serialized(self) -> Iterator[None]:
        """One check or run at a time on this runner's connection, on the DB now at the path
        (one deleted or moved aside is reopened; one found corrupt raises StateCorrupt)."""
        with self._busy:
            self.store.follow_path()
            with self.store.guard():
                yield

    def needs_gc(self) -> tuple[GcReason, ...]:
        """The cheap check (see the module docstring), on an index not held back by a lock."""
        with self._serialized():
            return needs_gc(
                self.layout,
                self.store,
                self.policy,
                now=self.clock(),
                disk_usage=self.disk_usage,
                ahead=self.ahead(),
                pending=index_current(self.live.pending()),
            )

    def ahead(self) -> int:
        """Bytes the writer adds while a run frees space, at the pace of the last run."""
        return self.live.ahead(self.run_seconds)

    def _lead(self) -> bool:
        return self.live.may_lead() and self.leadership.try_acquire()

    def tick(self) -> GcReport | None:
        """One daemon cycle: run GC if a limit is crossed or a sweep is due, else nothing."""
        if not self._lead():
            self.stats.skipped += 1
            self.stats.unmet = ()  # another process keeps the limits: its own gauge says
            return None
        # The floor first: below it the DB the check reads may not open (cachemgr.gc.floor).
        floor = self._floor_pass("auto", self.policy)
        sweep = self.clock() - self.last_sweep >= self.policy.sweep_interval
        try:
            crossed = bool(self.needs_gc())
        except BaseException:
            self.stats.error += 1
            raise
        if not sweep and not crossed:
            self.stats.unmet = ()  # no limit is crossed now: none is unmet
            if floor is None:
                self.stats.last_success = self.clock()
            else:  # the pass was all this tick did: a run of its own, a success if it held
                self.stats.count(floor)
            return floor
        if sweep and crossed and not self._sweep_put_off:
            # A sweep lists every namespace dir before the plan is made: a crossed limit is
            # held by a run without it first, and the next tick sweeps whatever is crossed.
            self._sweep_put_off, sweep = True, False
        elif sweep:
            self._sweep_put_off = False
        # The run goes on from this pass and counts both as one run: a second pass at its
        # start would list every namespace dir again, for nothing, while the floor is unmet.
        return self.run(actor="auto", sweep=sweep, floor=floor)

    def free_floor(self) -> GcReport | None:
        """The loop's cycle between ticks: below the free-space floor, delete from a scan of
        the disk, without the DB (cachemgr.gc.floor), counted as a run of its own; None if free
        space is over the floor or another process leads."""
        report = self._floor_pass("auto", self.policy)
        if report is not None:
            self.stats.count(report)
        return report

    def _floor_pass(self, actor: str, policy: GcPolicy) -> GcReport | None:
        """Below the floor, the pass from a scan of the disk, audited (or its rows held) but
        not counted: the caller counts it, alone or joined with the run it starts; `policy`
        replaces the runner's own for this pass (one-off limits)."""
        fence = self.leadership.run_fence()
        try:
            with self._busy:
                report = floor_pass(
                    self.layout,
                    policy,
                    disk_usage=self.disk_usage,
                    pacer=Pacer(rate=policy.delete_rate),
                    clock=self.clock,
                    stop=lambda: self._stopping.is_set() or not fence(),
                    gate=self._lead,
                )
        except BaseException:
            self.stats.error += 1
            raise
        if report is None:
            self._write_held()
            return None
        with self._busy:
            self.record_floor(report, actor)
            self._drained(report)
        return report

    def record_floor(self, report: GcReport, actor: str) -> None:
        """Audit a floor pass made by this runner or its caller (cachemgr.gc.floor), or hold
        its rows until the DB takes writes."""
        record_floor(self.layout, self.store, report, actor, self.held)

    def _write_held(self) -> None:
        """Write the audit rows held since the DB took no writes, if it takes them now (else
        they stay held: that was said when they were, and the cycle goes on)."""
        if not self.held:
            return
        with self._busy:
            try:
                self.held.write(self.store)
            except (sqlite3.Error, OSError, StateError) as e:
                log.debug("held audit rows not written yet", extra={"error": str(e)})

    def run(
        self,
        *,
        dry_run: bool = False,
        actor: str = "auto",
        sweep: bool = True,
        pacer: Pacer | None = None,
        progress: Progress | None = None,
        policy: GcPolicy | None = None,
        floor: GcReport | None = None,
        locked: Callable[[str], None] = unheeded,
    ) -> GcReport:
        """Plan and execute one GC run; a non-leader reports who leads and deletes nothing
        (a dry run plans all the same, and says who leads).

        Below the free-space floor, the floor pass (cachemgr.gc.floor) goes first, and a dry
        run plans it too: the plan after it counts its files as gone, so the dry run lists
        what the real run deletes. `floor`: the pass the caller made already (the CLI, before
        it opened the DB), not made again; either is in the report. Unless a `pacer` is given
        for all of it, the steps that hold a limit go first, unpaced, and the rest at the
        policy's delete_rate, yielding to a limit crossed meanwhile (cachemgr.gc.behind); `policy`
        replaces the runner's own for this run (one-off limits). `locked`: told who holds the
        state DB's write lock if a record of deleted files waits for it (RunContext.locked).
        """
        if not dry_run and not self._lead():
            now = self.clock()
            return GcReport(dry_run, False, now, now, holder=self.leadership.holder())
        if floor is None:
            floor = self._floor_first(dry_run, actor, policy or self.policy)
        elif not dry_run:
            self._write_held()
        # Planned only: the plan counts its files gone. Done: the disk says so, and its pages
        # left the index with its audit row (record_floor).
        after = Earlier()
        if floor is not None and floor.dry_run:
            after = Earlier.of([r.step for r in floor.steps])
        with self._serialized():
            try:
                run = RunContext(
                    self.layout,
                    self.store,
                    actor=actor,
                    dry_run=dry_run,
                    pacer=pacer,
                    clock=self.clock,
                    stop=self._stopping.is_set,
                    fence=self.leadership.run_fence(),
                    users=self.live.users,
                    locked=locked,
                )
                report = joined(floor, self._run(run, sweep, progress, policy, after))
            except BaseException:
                self.stats.error += 1
                raise
        if dry_run and not self.leadership.held and self.leadership.led_elsewhere():
            return replace(report, leader=False, holder=self.leadership.holder())
        if not dry_run:
            self.stats.count(report)
            if policy is None:  # one-off limits say nothing of the daemon's own
                self.stats.unmet = report.unmet
            reserve.keep(self.layout.state_dir)
            self._note_denied(report)
            self.live.after_run(self)
        if report.locked_by is not None:  # counted above: what it deleted is recorded
            raise GcLocked(
                f"state DB {self.store.path} was write-locked by {report.locked_by}: GC stopped "
                "deleting (what it deleted is in the index and the audit) and runs again once "
                "the lock is released",
                report,
            )
        return report

    def _floor_first(self, dry_run: bool, actor: str, policy: GcPolicy) -> GcReport | None:
        """The floor pass a run starts with (checked only, in a dry run); None if free space
        is over the floor."""
        if not dry_run:
            return self._floor_pass(actor, policy)
        return floor_pass(
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
        run: RunContext,
        sweep: bool,
        progress: Progress | None,
        policy: GcPolicy | None,
        after: Earlier,
    ) -> GcReport:
        own_limits = policy is None  # (one-off limits say nothing of the daemon's own)
        policy = policy or self.policy
        dry_run = run.dry_run
        now = self.clock()
        t0 = time.monotonic()
        if sweep:  # counted again each sweep: another process's drain is not told here
            self.trash = TrashCounts()
        flight = self.live.in_flight()
        model = self.live.model
        live = Live(
            model,
            self.live.pending(),
            self.ahead(),
            flight.queued,
            flight.stored,
            flight.stored_bytes,
            self.trash,
            self.temps,
        )
        if self.layout.node is not None:  # in a fleet: whom the other nodes' servers use
            catch_up(self.layout, self.store)
        plan = plan_gc(
            self.layout,
            self.store,
            policy,
            now=now,
            disk_usage=self.disk_usage,
            sweep=sweep,
            live=live,
            after=after,
        )
        if sweep and not dry_run:
            self.last_sweep = now
        if not dry_run:
            self.stats.overridden += plan.overridden
        behind = None
        if run.pacer is None:  # no pace asked for: the limits first, unpaced, the rest Behind
            run = replace(run, pacer=Pacer(rate=None))
            if not dry_run:  # (a dry run lists all a run would do, uncut)
                # Only the loop's own runs yield: one asked for (HTTP, the CLI) does it all.
                give_way = self.give_way if run.actor == "auto" else GiveWay(threading.Event())
                behind = give_way.behind(policy.delete_rate, self.not_holding.set)
        if not dry_run and any(s.reason in HOLDING for s in plan.steps):
            self.not_holding.clear()
        try:
            report = execute_gc(
                plan,
                run,
                progress=progress,
                spare=flight.spare,
                unlinking=Applied.of(self.live.unlinking(), flight.stored),
                recorded=forgetting(self.live.model, self.live.gone_early, flight.stored),
                after_limits=behind,
            )
        except (sqlite3.Error, OSError, StateError) as e:
            if own_limits and not dry_run and reserve.is_disk_full(e, self.layout.state_dir):
                # A chunk's deletion is recorded before the next goes, and the state dir's
                # filesystem took no record: the limits it held stay over, said so (not
                # "held", as the last run that worked left them).
                self.stats.unmet = unrecorded_unmet(plan)
            raise
        finally:
            self.not_holding.set()
        if not dry_run:
            self.stats.overridden += report.overridden
            self._drained(report)
        if _holding(plan) and not dry_run:  # a paced run's minutes are not cap-holding's
            # The longest recent run, decaying: a quick one must not start the next late.
            self.run_seconds = max(time.monotonic() - t0, self.run_seconds / 2)
        return report

    def _drained(self, report: GcReport) -> None:
        """What a run or floor pass drained of each trash entry leaves of its count."""
        if report.dry_run:
            return
        for r in report.steps:
            if r.reason == "trash":
                self.trash.drained(r.rel_dir.removeprefix(".trash/"), r.files + r.vanished, r.bytes)

    def wake(self) -> None:
        """Ask for a check now (the watcher saw the index grow past a watermark)."""
        self.live.woken.set()

    def _interrupt(self) -> None:
        self.wake()

    def _loop(self) -> None:
        """The daemon's GC loop: a tick at once (once `ready` is set), then every interval or
        when woken, until stopped."""
        stop = self._stopping
        ready = self.live.ready
        woken_event = self.live.woken
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
                woken = woken_event.wait(max(wait, 0.0))
                woken_event.clear()
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
            self.held.abandon()
            self.leadership.release()

    def _cycle(self, run: Callable[[], GcReport | None]) -> bool:
        """One daemon cycle; True if it ran GC, freed nothing and a limit is still crossed, or
        failed: pause before the next. (A run with nothing to free, such as the sweep at
        start-up, is no reason to ignore the wakes of a writer that crosses a watermark next.)"""
        try:
            report = run()
            # (A run that gave way to a wake deleted nothing maybe, but is not stuck: the
            # loop runs again at once, for the limit that woke it.)
            freed = report is None or report.files > 0 or self.give_way.yielded
            stuck = not freed and bool(self.needs_gc())
        except StateCorrupt as e:  # moved aside; the indexer rebuilds, the next cycle runs
            log.warning("gc cycle stopped", extra={"error": str(e)})
            return True
        except OSError as e:
            if is_denied(e) and not self._root_usable():
                key = denied_key(self.layout)
                self.quarantine.mark(key, "unreadable", e)  # said once; the index clears it
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


def _holding(plan: GcPlan) -> bool:
    """Whether the plan only holds a cap or the free-space floor."""
    return all(s.reason in HOLDING for s in plan.steps)
