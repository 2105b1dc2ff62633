"""The live index: one writer thread that scans, then applies watcher events in batches.

Only this thread writes the page index while the daemon runs; the inotify thread only appends
to a deque. Every `batch_interval` the queue is drained and applied in 2K-event transactions
(cachemgr.daemon.page_events). After each batch `on_applied` runs (the daemon's cheap GC
check). An inotify overflow, a new namespace dir and the periodic reconcile all become scans,
so drift is bounded and counted. cachemgr.daemon.index_leader says which daemon writes.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cachemgr.daemon import heap
from cachemgr.daemon.backlog import StoreBacklog
from cachemgr.daemon.events import Event, Kind
from cachemgr.daemon.index_leader import lead, mark_ready
from cachemgr.daemon.index_state import IndexState
from cachemgr.daemon.page_events import PageEvents
from cachemgr.daemon.watcher import Watcher
from cachemgr.errors import StateCorrupt, StateError, StateLocked, UnsafePathError
from cachemgr.fs import reserve
from cachemgr.fs.leadership import Leadership
from cachemgr.fs.safe import open_dir
from cachemgr.gc import modelfile
from cachemgr.gc.chains import ChainModel
from cachemgr.layout import NS_DIR, Layout
from cachemgr.ns.manifest import format_of
from cachemgr.ns.quarantine import (
    ROOT,
    STATE_DIR,
    Quarantine,
    denied_key,
    is_denied,
    ns_root_problem,
    state_dir_full,
)
from cachemgr.ns.registry import adopt_from_disk
from cachemgr.state import pages_sql
from cachemgr.state.index import (
    ScanReport,
    forget_namespace,
    last_removal,
    scan_namespace,
    scan_root,
)
from cachemgr.state.store import Store
from cachemgr.worker import DeathHandler, Worker

log = logging.getLogger(__name__)
FULL_RETRY = 1.0  # seconds before the first retry of a write the full disk refused
# Each retry a full disk refuses doubles the wait, up to this: a build retried is a scan of
# every namespace, and a state dir on another filesystem than the root's stays full until
# a person frees it (it was rescanned every second for as long).
FULL_RETRY_MAX = 30.0
ROOT_RETRY = 5.0  # seconds between listings of a root found unreadable
BUILD_ATTEMPTS = 3  # a fresh DB found corrupt again: the disk or SQLite is failing, stop
# Page events per transaction: a batch waits for a GC run holding a cap (hooks.before_batch),
# and a run's chunk transactions wait for a batch's; neither should wait long.
EVENT_BATCH = 2_000


@dataclass(frozen=True)
class IndexerConfig:
    """How the index writer runs: its pace, its clock, and which daemon writes the root."""

    batch_interval: float = 0.25  # seconds between two batches of page events
    reconcile_interval: float = 600.0  # seconds between two full rescans
    clock: Callable[[], float] = time.time
    leadership: Leadership | None = None  # None: this process alone indexes the root
    ready_marker: Path | None = None  # exists while the leader's index is live


@dataclass(frozen=True)
class IndexerShared:
    """What the index writer shares with the rest of the daemon, which builds each first
    (None: the writer's own)."""

    watcher: Watcher | None = None
    state: IndexState | None = None  # its counters and flags, for metrics and the API
    model: ChainModel | None = None  # what GC evicts by: every indexed page and its chain
    backlog: StoreBacklog | None = None  # stores the watcher saw, not applied yet
    # Namespaces (or the root) this process cannot read: skipped, said once, retried.
    quarantine: Quarantine | None = None


@dataclass(frozen=True)
class IndexerHooks:
    """What the daemon does on the index thread when the index changes (see Indexer)."""

    on_applied: Callable[[], None] = lambda: None
    on_namespace_gone: Callable[[str], None] = lambda _: None
    on_disk_full: Callable[[], None] = lambda: None
    # Before each batch of page events: wait (briefly) for a GC run that holds a cap.
    before_batch: Callable[[], object] = lambda: None


class Indexer(Worker):
    """Runs the scan + watch + apply loop on its own thread; `stop()` finishes the batch.

    On this thread: `on_applied` once the index is built and after each batch of page events,
    `on_namespace_gone` after a namespace dir left ns/ (any process's purge moved it to .trash/),
    `on_disk_full` when a write failed for lack of space (free some now).
    """

    def __init__(
        self,
        layout: Layout,
        store: Store,
        config: IndexerConfig = IndexerConfig(),
        shared: IndexerShared = IndexerShared(),
        hooks: IndexerHooks = IndexerHooks(),
        *,
        on_death: DeathHandler | None = None,
    ) -> None:
        super().__init__("index", on_death=on_death)
        self.quarantine = shared.quarantine if shared.quarantine is not None else Quarantine()
        self._root_retry = 0.0  # when an unreadable root is listed again
        self.store = store
        self.layout = layout
        self.batch_interval = config.batch_interval
        self.reconcile_interval = config.reconcile_interval
        self.clock = config.clock
        self.state = shared.state if shared.state is not None else IndexState()
        self.backlog = shared.backlog if shared.backlog is not None else StoreBacklog()
        self.watcher = shared.watcher if shared.watcher is not None else Watcher(layout)
        self.watcher.on_store = self.backlog.stored
        self.watcher.gaps = self.state.watch_gaps
        self.leadership = config.leadership
        self.ready_marker = config.ready_marker
        self.follow_interval = max(config.batch_interval, 0.05)
        model = shared.model
        self.model = model if model is not None else ChainModel(lambda ns: format_of(layout, ns))
        # Namespaces the model holds as the index does; those from a snapshot not scanned since.
        self._loaded = set[str]()
        self._restored = set[str]()
        self.save_model = True  # at a clean stop (False: GC may still change the index)
        self.pages = PageEvents(layout, store, self.model, self.backlog)
        self.on_applied = hooks.on_applied
        self.on_namespace_gone = hooks.on_namespace_gone
        self.on_disk_full = hooks.on_disk_full
        self.before_batch = hooks.before_batch
        self._rescan = set[str]()
        self._rescan_lock = threading.Lock()
        self._next_reconcile = float("inf")  # set once the first scan is done
        self._unverified = False  # ready from the model file, before the first tick's scan
        self._unloaded = set[str]()  # indexed by the first build; GC's model loads after ready
        self._full_streak = 0  # writes the full disk refused running (the retries back off)

    def stop(self, timeout: float = 30.0) -> bool:
        """Apply what is queued, stop the watcher, and return once the thread is done."""
        done = super().stop(timeout)
        self.watcher.stop()  # the thread released index leadership on its way out
        return done

    def lag(self) -> float:
        """Age in seconds of the oldest event not yet applied (0 when the queue is empty)."""
        try:
            oldest = self.watcher.queue[0][3]
        except IndexError:
            return 0.0
        return max(0.0, time.monotonic() - oldest)

    def request_rescan(self, ns_id: str | None = None) -> None:
        """Ask for a rescan of one namespace (or all) at the next batch."""
        with self._rescan_lock:
            self._rescan.add(ns_id or "*")

    def _loop(self) -> None:
        try:
            took_over = lead(
                self.leadership,
                self.ready_marker,
                self.state,
                stopping=self._stopping,
                interval=self.follow_interval,
            )
            if self._stopping.is_set():
                return
            mark_ready(self.ready_marker, False)  # followers wait for this leader's first scan
            self.watcher.start()
            t0 = time.perf_counter()
            while not self._written(lambda: self._build(first=not took_over)):
                if self._stopping.wait(self._retry_pause()):
                    return
            pending = self._pending()
            if not self._unverified:  # (else once verified: followers, CLIs count by it)
                mark_ready(self.ready_marker, True)
            self.state.live(True, pending=pending)
            took = round(time.perf_counter() - t0, 3)
            log.info(
                "index ready",
                extra={"scans": self.state.scans, "seconds": took, "gc_waits_for": pending},
            )
            self.on_applied()  # the index as built may be over a limit already
            if not self._unverified:  # (else due at the first tick: _restored_live)
                self._next_reconcile = time.monotonic() + self.reconcile_interval
            pause = self.batch_interval
            while not self._stopping.wait(pause):
                ok = self._written(lambda: self._survive_corruption(self._tick))
                pause = self.batch_interval if ok else self._retry_pause()
            done = self._written(lambda: self._survive_corruption(self.apply_pending))
            if done and self.save_model and self.state.ready.is_set():  # for the next start
                modelfile.save(self.model, self.layout.model_snapshot, self.store, self._loaded)
        finally:
            if self.state.leader and self.leadership is not None:
                mark_ready(self.ready_marker, False)
                self.state.leader = False  # nor may this process lead GC any more
                self.leadership.release()  # a follower takes over (and rescans)

    def _died(self, error: BaseException) -> None:
        self.state.live(False)  # a dead index is not live

    def _written(self, write: Callable[[], object]) -> bool:
        """Run `write`; False if the disk was too full for it, another connection held the
        DB's write lock past the store's patience, or the root became unreadable (retried
        later: events that were not applied are back in the queue; on a full disk GC is told
        to free space)."""
        try:
            write()
        except StateLocked:  # said once by cachemgr.state.busy; the queue waits meanwhile
            return False
        except (sqlite3.Error, OSError) as e:
            if is_denied(e):  # the state dir (or ns/) made unreadable: wait for it
                self._denied(e)
                return False
            if not reserve.is_disk_full(e, self.layout.state_dir):
                raise
            self._full(e)
            return False
        self.quarantine.clear(STATE_DIR, "unreadable")
        self.quarantine.clear(STATE_DIR, "full")
        self._full_streak = 0  # the next refusal backs off from FULL_RETRY again
        self.state.disk_full = False
        return True

    def _full(self, error: OSError | sqlite3.Error) -> None:
        """A write the state dir's full filesystem refused: hold the state dir aside (said
        once, with who frees the space: GC, or a person when it is not the root's), give the
        reserve back and wake GC."""
        self.quarantine.mark(STATE_DIR, "full", f"{state_dir_full(self.layout)} ({error})")
        self.state.disk_full = True
        self.state.disk_full_retries += 1
        self._full_streak += 1
        reserve.release(self.layout.state_dir)
        self.on_disk_full()

    def _retry_pause(self) -> float:
        """Seconds before a write that failed is tried again: FULL_RETRY, doubled for each
        time running the full disk refused it, up to FULL_RETRY_MAX."""
        doublings = min(max(self._full_streak - 1, 0), 8)  # (2**8 s is past the cap already)
        return min(FULL_RETRY * (1 << doublings), FULL_RETRY_MAX)

    def _denied(self, error: OSError | sqlite3.Error) -> None:
        """Hold the state dir or the root aside, whichever refused, and list again soon."""
        self._hold_aside(denied_key(self.layout), error)

    def _hold_aside(self, key: str, why: BaseException | str) -> None:
        """Mark `key` (the root or the state dir) unreadable; listed again after ROOT_RETRY."""
        self.quarantine.mark(key, "unreadable", why)
        self._root_retry = time.monotonic() + ROOT_RETRY

    def _build(self, *, first: bool) -> None:
        """Scan every namespace into the DB now at the path; a DB found corrupt meanwhile is
        moved aside (Store.guard) and the scan starts over on a fresh one."""
        for _ in range(BUILD_ATTEMPTS):
            try:
                with (store := self.store).guard():
                    store.follow_path()
                    # after earlier seqs; every namespace is loaded again from this DB
                    self.pages = PageEvents(self.layout, store, self.model, self.backlog)
                    restored = modelfile.restore(self.model, self.layout.model_snapshot, store)
                    self._restored, self._loaded = restored, set(restored)
                    # (A DB replaced while this daemon runs is scanned at once, as ever.)
                    early = first and not self.state.ready.is_set()
                    if not (early and self._restored_live()):
                        self._scan_all(first=first)
                return
            except StateCorrupt:
                continue
        raise StateError(f"state DB {self.store.path} was corrupt {BUILD_ATTEMPTS} times running")

    def _restored_live(self) -> bool:
        """Whether a start from the model file may be ready before it scans: the snapshot held
        the index exactly (no other process wrote it since the last clean stop), so all that
        can differ is what changed on disk while no daemon watched, which the first tick's
        scan finds. A scan of every page file costs a cold `du` (155 s at 10M pages), and
        a sidecar's readiness holds its pod (SGLang with it) out of service. The namespaces
        the model holds are watched first: from here on nothing is missed. GC's runs wait for
        the scan (IndexState.settled) as for a first scan."""
        indexed = pages_sql.namespace_bytes(self.store.conn).keys()  # (namespaces with pages)
        if not self._restored or not self._restored >= indexed:
            return False  # (GC would find no order for a namespace the model lacks)
        if not all(self.watcher.watch(ns) for ns in self._restored):
            return False
        self._unverified = True
        self._next_reconcile = 0.0  # the first tick scans
        return True

    def _tick(self) -> None:
        """One batch interval: follow the DB file, apply the queue, reconcile when due."""
        if self.store.follow_path():  # deleted, moved aside as corrupt, or replaced by a CLI
            log.warning(
                "state DB file replaced, deleted or moved aside; rebuilding the index from disk",
                extra={"db": str(self.store.path)},
            )
            self._build(first=True)
        # GC's model where the first build left it for after ready (112 s at 10M pages), before
        # the events queued meanwhile: they teach it links and reads.
        while self._unloaded:
            self._load(next(iter(self._unloaded)))
        if ROOT not in self.quarantine:
            self._root_unusable()  # (else the retry below looks again)
        self.apply_pending()
        # (A full state dir needs no scan: the events its writes refused wait in the queue.)
        waiting = ROOT in self.quarantine or self.quarantine.holds(STATE_DIR, "unreadable")
        if waiting and time.monotonic() >= self._root_retry:
            self._scan_all(first=False)  # back to normal once it can be listed again
        if time.monotonic() >= self._next_reconcile:
            self._scan_all(first=self._unverified)  # (downtime's changes are no drift)
            self._next_reconcile = time.monotonic() + self.reconcile_interval
            self._unverified = False
        if self.state.settling and not self._pending():
            mark_ready(self.ready_marker, True)
            self.state.settle()
            log.info("index settled", extra={"scans": self.state.scans})

    def _pending(self) -> str:
        """What GC's runs wait for once the index is ready ("": nothing)."""
        if self._unverified:
            return "the scan of what changed while down (restored from the model file)"
        if self._unloaded:
            return "its model of the pages is loaded"
        return ""

    def _load(self, ns: str) -> None:
        self.model.load(self.store.conn, ns)
        self._loaded.add(ns)
        self._unloaded.discard(ns)

    def _survive_corruption(self, step: Callable[[], object]) -> None:
        """Run `step`; a corrupt DB is moved aside and rebuilt at the next tick, and the
        events of the failed batch are covered by that rebuild's scan."""
        try:
            with self.store.guard():
                step()
        except StateCorrupt:
            pass

    def apply_pending(self) -> int:
        """Drain the queue and apply it; returns the number of events applied."""
        queue = self.watcher.queue
        n = len(queue)
        held: list[Event] = []  # taken from the queue, not applied yet
        self.watcher.applying = held
        try:
            for _ in range(n):
                ev = queue.popleft()
                held.append(ev)
                if ev[0] >= Kind.NS_ADDED:
                    self._apply_pages(held[:-1])
                    del held[:-1]
                    self._apply_namespace_event(ev)
                    held = self.watcher.applying = []
                elif len(held) >= EVENT_BATCH:
                    self._apply_pages(held)
                    held = self.watcher.applying = []
            self._apply_pages(held)
            self.watcher.applying = []
        except BaseException:
            self.watcher.applying = []
            # A write the disk refused (full) is retried: its events go back in front, in order.
            queue.extendleft(reversed(held))
            raise
        with self._rescan_lock:
            wanted, self._rescan = self._rescan, set()
        try:
            if "*" in wanted:
                self._scan_all(first=False)
            else:
                for ns in sorted(wanted):
                    self._scan(ns, first=False)
        except BaseException:
            with self._rescan_lock:
                self._rescan |= wanted  # asked for still
            raise
        self.state.events_applied += n
        return n

    def _apply_namespace_event(self, ev: Event) -> None:
        kind, ns, *_ = ev
        if kind is Kind.OVERFLOW:
            self.state.overflows += 1
            log.warning("inotify queue overflowed; rescanning every namespace")
            self._scan_all(first=False)
        elif kind is Kind.NS_ADDED:
            self._scan(ns, first=False)
        elif kind is Kind.NS_GONE:
            self.watcher.unwatch(ns)
            if not self.layout.ns_dir(ns).is_dir():
                self._forget(ns)
                self._log_gone(ns, forget_namespace(self.store, ns))
            self.on_namespace_gone(ns)  # even if a purge recreated it empty

    def _log_gone(self, ns: str, removed: int) -> None:
        # A purge or a GC drop took the rows with the dir, so the index removes none: the
        # audit row it wrote says what the namespace held.
        audited = last_removal(self.store, ns) if removed == 0 else None
        counts = audited or {"pages": removed, "removed_by": "outside cachemgr"}
        log.info("namespace dir gone", extra={"namespace": ns, **counts})

    def _apply_pages(self, events: list[Event]) -> None:
        if events:
            self.before_batch()
        for ns, (r, w) in self.pages.apply(events, now=self.clock()).items():
            c = self.state.counter(ns)
            c.reads, c.writes = c.reads + r, c.writes + w
        self.state.note_stored(self.pages.stored_bytes, time.monotonic())
        if events:
            self.on_applied()

    def _root_unusable(self) -> bool:
        """Whether <root>/ns is gone, a symlink, a file or not listable: then the root is held
        aside (its index rows kept, as for a root made unreadable) and looked at again every
        ROOT_RETRY. Without this a removed ns/ read as a root without namespaces, a symlinked
        one failed every metrics refresh, and the daemon said it was healthy."""
        problem = ns_root_problem(self.layout)
        if problem is None:
            return False
        self._hold_aside(ROOT, problem)
        return True

    def _scan_all(self, *, first: bool) -> None:
        if self._root_unusable():
            return
        # Usable again (a new ns/ dir has no watch yet), or its watch refused (none was left)
        if ROOT in self.quarantine or self.watcher.root_refused():
            self.watcher.watch_root()
        try:
            adopt_from_disk(self.layout, self.store)  # a lost DB forgot them; the disk did not
            scan_root(
                self.layout,
                self.store,
                scan=lambda ns: self._scan(ns, first=first),
                forgetting=self._forget,
            )
        except OSError as e:  # ns/ or the state dir cannot be used: wait, the index kept
            if not is_denied(e):
                raise
            self._denied(e)
            return
        except UnsafePathError as e:  # ns/ replaced by a symlink since it was looked at
            self._hold_aside(ROOT, e)
            return
        self.quarantine.clear(ROOT, "unreadable")
        self.quarantine.clear(STATE_DIR, "unreadable")

    def _readable(self, ns: str) -> bool:
        """Whether this process may list the namespace dir; one it may not is held aside
        (its index rows kept as they were) until a later scan finds it readable."""
        try:
            with open_dir(self.layout.root, f"{NS_DIR}/{ns}") as fd, os.scandir(fd) as it:
                next(it, None)
        except OSError as e:
            if is_denied(e):
                self.quarantine.mark(ns, "unreadable", e)
                return False
            return True  # gone, or a symlink: watch() and the scan say so as before
        except UnsafePathError:
            return True
        self.quarantine.clear(ns, "unreadable")
        return True

    def _forget(self, ns: str) -> None:
        self.watcher.unwatch(ns)
        self.model.forget(ns)
        self._loaded.discard(ns)

    def _scan(self, ns: str, *, first: bool) -> ScanReport | None:
        # Watch first, then list: an event racing the scan is applied after it and settled
        # by a stat, so nothing falls between the two.
        if not self._readable(ns):
            return None
        if not self.watcher.watch(ns) and not self.watcher.refused(ns):
            return None  # gone (a watch refused at the kernel's limit: scanned all the same)
        fresh = ns in self._restored  # (from a snapshot: the scan says what changed, exactly)
        try:
            report = scan_namespace(
                self.layout,
                self.store,
                ns,
                now=self.clock,
                fmt=self.watcher.format_of(ns),
                changes=fresh,
            )
        except UnsafePathError as e:  # replaced by a symlink since it was watched
            log.error("namespace dir not scanned", extra={"namespace": ns, "error": str(e)})
            return None
        except OSError as e:  # made unreadable since it was watched (chmod 000)
            if not is_denied(e):
                raise
            self.quarantine.mark(ns, "unreadable", e)
            return None
        if report.files:  # the size of the page files to come (a store is one file: a
            # TP-2 page is two), before a store is applied
            self.backlog.done(0, -(-report.bytes // report.files))
        self._restored.discard(ns)
        if report.changes is not None:  # (what changed while the daemon was down)
            modelfile.apply_scan(self.model, ns, report.changes)
        elif not self.state.ready.is_set() and ns not in self._loaded:
            self._unloaded.add(ns)  # a first build: ready first, GC's model after (_tick)
        elif report.drift or ns not in self._loaded:
            self._load(ns)  # the scan changed what the model knew
        heap.trim()  # what the scan and a load freed (cachemgr.daemon.heap)
        self.state.record_scan(report, first=first)
        return report
