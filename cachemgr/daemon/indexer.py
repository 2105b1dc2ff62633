"""The live index: one writer thread that scans, then applies watcher events in batches.

Only this thread writes the page index while the daemon runs; the inotify thread only appends
to a deque. Every `batch_interval` the queue is drained and applied in 10K-event transactions.
Page stores and deletions are settled by a stat of the file at apply time (the disk is the
truth, so a create+delete inside one batch, or an event seen twice, needs no ordering care);
reads bump the page's `reads` and `last_access`, and every read and store takes the next
`access_seq` (GC's order inside a burst). After each batch `on_applied` runs (the daemon's
cheap GC check). An inotify overflow, a new namespace dir and the periodic reconcile all
become scans, so any drift is bounded and counted.

Several daemons may serve one root (one sidecar per server on a shared cache dir). Per kernel
(inotify reports what happens on this kernel: pods on one node share it, hosts sharing the root
over NFS do not) only the daemon holding <state_dir>/index-<boot id>.lock watches and writes
the index; the others *follow*: they serve the shared DB, count no events (counted twice,
every read would be), are ready while the leader's `.ready` marker exists, and try the lock
every batch interval. One that takes over rescans first (cheap when the index still matches
the disk: cachemgr.state.index) to catch what happened while nobody watched.
"""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from cachemgr.backends import FileFormat
from cachemgr.daemon.watcher import Event, Kind, Watcher
from cachemgr.errors import StateCorrupt, StateError, UnsafePathError
from cachemgr.fs import reserve
from cachemgr.fs.leadership import Leadership
from cachemgr.fs.safe import open_dir, open_file
from cachemgr.layout import Layout
from cachemgr.ns.registry import adopt_from_disk
from cachemgr.sglang.hicache import HICACHE_FILE
from cachemgr.state.index import BATCH, ScanReport, forget_namespace, namespace_dirs, scan_namespace
from cachemgr.state.store import Store

log = logging.getLogger(__name__)
FULL_RETRY = 1.0  # seconds between retries of a write the full disk refused
BUILD_ATTEMPTS = 3  # a fresh DB found corrupt again: the disk or SQLite is failing, stop


@dataclass
class Counters:
    """Page reads and writes of one namespace seen since the daemon started."""

    reads: int = 0
    writes: int = 0


@dataclass
class IndexState:
    """What the writer knows, for metrics and the API (read without locks: ints only)."""

    started_at: float = field(default_factory=time.time)
    ready: threading.Event = field(default_factory=threading.Event)
    counters: dict[str, Counters] = field(default_factory=dict)
    overflows: int = 0
    scans: int = 0
    scan_seconds_total: float = 0.0
    last_scan_seconds: float = 0.0
    last_scan_at: float = 0.0
    drift_pages: int = 0  # rows added or removed by scans after the first
    events_applied: int = 0
    batches: int = 0
    leader: bool = False  # this process watches and writes the index (see the module doc)
    disk_full: bool = False  # the last write failed for lack of space; retried
    disk_full_retries: int = 0

    def counter(self, ns_id: str) -> Counters:
        got = self.counters.get(ns_id)
        if got is None:
            got = self.counters[ns_id] = Counters()
        return got


class PageEvents:
    """Applies page events to the index, giving each read and write a global sequence number.

    A request reads its pages front to back and writes new ones after them, so the sequence
    tells GC which pages of a burst are further down a prefix chain (cachemgr.gc.order); the clock
    does not (a burst of thousands of reads shares one batch time). The counter resumes after
    the largest stored value, so the order survives a restart.
    """

    def __init__(self, store: Store, layout: Layout, fmt: FileFormat = HICACHE_FILE) -> None:
        self.store, self.layout, self.fmt = store, layout, fmt
        self._next: int | None = None  # read at first use, on the thread that applies

    def apply(self, events: list[Event], *, now: float) -> dict[str, list[int]]:
        """Apply events in the order seen; returns [reads, writes] per namespace."""
        if not events:
            return {}
        if self._next is None:
            row = self.store.conn.execute("SELECT COALESCE(MAX(access_seq), 0) FROM pages")
            self._next = int(row.fetchone()[0]) + 1
        touched: dict[tuple[str, str], bool] = {}  # (ns, name) -> stored in this batch
        reads: Counter[tuple[str, str]] = Counter()
        seqs: dict[tuple[str, str], int] = {}  # (ns, name) -> sequence of its last access
        per_ns: dict[str, list[int]] = {}  # ns -> [reads, writes]
        seq = self._next
        for kind, ns, name, _ in events:
            tally = per_ns.setdefault(ns, [0, 0])
            key = (ns, name)
            if kind is Kind.READ:
                reads[key] += 1
                tally[0] += 1
                seqs[key] = seq
                seq += 1
            else:
                stored = kind is Kind.WRITE
                touched[key] = touched.get(key, False) or stored
                tally[1] += stored
                if stored:
                    seqs[key] = seq
                    seq += 1
        self._next = seq
        upserts, deletes = self._settle(touched, seqs, now)
        with self.store.transaction() as conn:
            conn.executemany(
                "INSERT INTO pages (namespace_id, name, size, created_at, last_access, access_seq,"
                " key_len) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (namespace_id, name) DO UPDATE"
                " SET size = excluded.size, last_access = max(last_access, excluded.last_access),"
                " access_seq = max(access_seq, excluded.access_seq)",
                upserts,
            )
            conn.executemany("DELETE FROM pages WHERE namespace_id = ? AND name = ?", deletes)
            conn.executemany(
                "UPDATE pages SET reads = reads + ?, last_access = max(last_access, ?),"
                " access_seq = max(access_seq, ?) WHERE namespace_id = ? AND name = ?",
                ((n, now, seqs[key], *key) for key, n in reads.items()),
            )
            for ns, (r, w) in per_ns.items():
                _add_lifetime(conn, ns, r, w, now)
        return per_ns

    def _settle(
        self, touched: dict[tuple[str, str], bool], seqs: dict[tuple[str, str], int], now: float
    ) -> tuple[list[tuple[str, str, int, float, float, int, int]], list[tuple[str, str]]]:
        """Split touched pages into rows to upsert (file exists) and rows to delete."""
        upserts, deletes = [], []
        for (ns, name), stored in touched.items():
            try:
                st = os.stat(os.path.join(self.layout.ns_root, ns, name), follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                deletes.append((ns, name))
                continue
            seen = now if stored else min(st.st_mtime, now)
            key_len = self.fmt.key_len(name) or len(name)  # the watcher passes pages only
            upserts.append((ns, name, st.st_size, seen, seen, seqs.get((ns, name), 0), key_len))
        return upserts, deletes


def kernel_id() -> str:
    """The running kernel's boot id: one indexer per kernel (see the module doc)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    except OSError:
        return socket.gethostname()


def leadership_files(layout: Layout) -> tuple[Leadership, Path]:
    """This kernel's index lock on the root, and the marker its leader keeps while ready."""
    boot = kernel_id()
    return Leadership(layout.index_lock(boot)), layout.index_ready(boot)


class Indexer:
    """Runs the scan + watch + apply loop on its own thread; `stop()` finishes the batch."""

    def __init__(
        self,
        store: Store,
        layout: Layout,
        *,
        batch_interval: float = 0.25,
        reconcile_interval: float = 600.0,
        clock: Callable[[], float] = time.time,
        watcher: Watcher | None = None,
        leadership: Leadership | None = None,
        ready_marker: Path | None = None,
    ) -> None:
        self.store = store
        self.layout = layout
        self.batch_interval = batch_interval
        self.reconcile_interval = reconcile_interval
        self.clock = clock
        self.state = IndexState()
        self.watcher = watcher if watcher is not None else Watcher(layout)
        self.fmt = self.watcher.fmt  # what the names in a namespace dir mean
        self.leadership = leadership  # None: this process alone indexes the root
        self.ready_marker = ready_marker  # exists while the leader's index is live
        self.follow_interval = max(batch_interval, 0.05)
        self.pages = PageEvents(store, layout, self.fmt)
        self.on_applied: Callable[[], None] | None = None  # after each batch of page events
        # after a namespace dir left ns/: a purge by any process moved it into .trash/
        self.on_namespace_gone: Callable[[str], None] | None = None
        self._stop = threading.Event()
        self._rescan: set[str] = set()
        self._rescan_lock = threading.Lock()
        self._next_reconcile = float("inf")  # set once the first scan is done
        self._thread = threading.Thread(target=self._run, name="cachemgr-index", daemon=True)
        self.error: BaseException | None = None
        self.on_error: Callable[[BaseException], None] | None = None
        self.on_disk_full: Callable[[], None] | None = None  # a write failed: free space now

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Apply what is queued, stop the watcher, and return once the thread is done."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.watcher.stop()  # the thread released index leadership on its way out

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

    def _run(self) -> None:
        try:
            took_over = self._lead()
            if self._stop.is_set():
                return
            self._mark_ready(False)  # followers wait for this leader's first scan
            self.watcher.start()
            t0 = time.perf_counter()
            while not self._written(lambda: self._build(first=not took_over)):
                if self._stop.wait(FULL_RETRY):
                    return
            self._mark_ready(True)
            self.state.ready.set()
            took = round(time.perf_counter() - t0, 3)
            log.info("index ready", extra={"scans": self.state.scans, "seconds": took})
            self._next_reconcile = time.monotonic() + self.reconcile_interval
            pause = self.batch_interval
            while not self._stop.wait(pause):
                ok = self._written(lambda: self._survive_corruption(self._tick))
                pause = self.batch_interval if ok else FULL_RETRY
            self._written(lambda: self._survive_corruption(self.apply_pending))
        except BaseException as e:
            log.exception("index writer failed")
            self.error = e
            self.state.ready.clear()
        finally:
            if self.state.leader and self.leadership is not None:
                self._mark_ready(False)
                self.state.leader = False  # nor may this process lead GC any more
                self.leadership.release()  # a follower takes over (and rescans)
        if self.error is not None and self.on_error is not None:
            self.on_error(self.error)  # the daemon exits non-zero

    def _written(self, write: Callable[[], object]) -> bool:
        """Run `write`; False if the disk was too full for it (retried later: events that
        were not applied are back in the queue, and GC is told to free space)."""
        try:
            write()
        except (sqlite3.Error, OSError) as e:
            if not reserve.is_disk_full(e, self.layout.state_dir):
                raise
            if not self.state.disk_full:
                log.error("index write failed: the disk is full; retrying as GC frees space",
                          extra={"error": str(e)})  # fmt: skip
            self.state.disk_full = True
            self.state.disk_full_retries += 1
            reserve.release(self.layout.state_dir)
            if self.on_disk_full is not None:
                self.on_disk_full()
            return False
        if self.state.disk_full:
            log.warning("index writes work again")
            self.state.disk_full = False
        return True

    def _build(self, *, first: bool) -> None:
        """Scan every namespace into the DB now at the path; a DB found corrupt meanwhile is
        moved aside (Store.guard) and the scan starts over on a fresh one."""
        for _ in range(BUILD_ATTEMPTS):
            try:
                with self.store.guard():
                    self.store.follow_path()
                    self.pages = PageEvents(self.store, self.layout, self.fmt)  # after earlier seqs
                    self._scan_all(first=first)
                return
            except StateCorrupt:
                continue
        raise StateError(f"state DB {self.store.path} was corrupt {BUILD_ATTEMPTS} times running")

    def _tick(self) -> None:
        """One batch interval: follow the DB file, apply the queue, reconcile when due."""
        if self.store.follow_path():  # deleted, moved aside as corrupt, or replaced by a CLI
            log.warning(
                "state DB file replaced, deleted or moved aside; rebuilding the index from disk",
                extra={"db": str(self.store.path)},
            )
            self._build(first=True)
        self.apply_pending()
        if time.monotonic() >= self._next_reconcile:
            self._scan_all(first=False)
            self._next_reconcile = time.monotonic() + self.reconcile_interval

    def _survive_corruption(self, step: Callable[[], object]) -> None:
        """Run `step`; a corrupt DB is moved aside and rebuilt at the next tick, and the
        events of the failed batch are covered by that rebuild's scan."""
        try:
            with self.store.guard():
                step()
        except StateCorrupt:
            pass

    def _lead(self) -> bool:
        """Wait until this process leads the index (or is stopped); True if it took over
        from another leader, whose last events nobody applied."""
        if self.leadership is None or self.leadership.try_acquire():
            self.state.leader = True
            return False
        log.info("another daemon indexes this root; following it",
                 extra={"holder": self.leadership.holder()})  # fmt: skip
        while True:
            # Ready while the leader's index is built and live: it marks that with a file.
            if self.ready_marker is not None and self.ready_marker.exists():
                self.state.ready.set()
            else:
                self.state.ready.clear()
            if self._stop.wait(self.follow_interval):
                return False
            if self.leadership.try_acquire():
                log.warning("the indexing daemon is gone; taking over the index")
                self.state.ready.clear()  # until this process's own rescan is done
                self.state.leader = True
                return True

    def _mark_ready(self, ready: bool) -> None:
        if self.ready_marker is None:
            return
        marker = self.ready_marker
        if ready:  # created new: the unlink at start took away whatever was planted there
            os.close(open_file(marker, os.O_WRONLY | os.O_CREAT))
            return
        with open_dir(marker.parent, "") as dir_fd, suppress(FileNotFoundError):
            os.unlink(marker.name, dir_fd=dir_fd)  # a link itself, never its target

    def apply_pending(self) -> int:
        """Drain the queue and apply it; returns the number of events applied."""
        queue = self.watcher.queue
        n = len(queue)
        held: list[Event] = []  # taken from the queue, not applied yet
        try:
            for _ in range(n):
                ev = queue.popleft()
                held.append(ev)
                if ev[0] >= Kind.NS_ADDED:
                    self._apply_pages(held[:-1])
                    del held[:-1]
                    self._apply_namespace_event(ev)
                    held = []
                elif len(held) >= BATCH:
                    self._apply_pages(held)
                    held = []
            self._apply_pages(held)
        except BaseException:
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
        self.state.batches += 1 if n else 0
        return n

    def _apply_namespace_event(self, ev: Event) -> None:
        kind, ns, _, _ = ev
        if kind is Kind.OVERFLOW:
            self.state.overflows += 1
            log.warning("inotify queue overflowed; rescanning every namespace")
            self._scan_all(first=False)
        elif kind is Kind.NS_ADDED:
            self._scan(ns, first=False)
        elif kind is Kind.NS_GONE:
            self.watcher.unwatch(ns)
            if not self.layout.ns_dir(ns).is_dir():
                removed = forget_namespace(self.store, ns)
                log.info("namespace dir gone", extra={"namespace": ns, "pages": removed})
            if self.on_namespace_gone is not None:  # even if a purge recreated it empty
                self.on_namespace_gone(ns)

    def _apply_pages(self, events: list[Event]) -> None:
        for ns, (r, w) in self.pages.apply(events, now=self.clock()).items():
            c = self.state.counter(ns)
            c.reads += r
            c.writes += w
        if events and self.on_applied is not None:
            self.on_applied()

    def _scan_all(self, *, first: bool) -> None:
        adopt_from_disk(self.layout, self.store)  # a lost DB forgot them; the disk did not
        present = namespace_dirs(self.layout)
        for ns in present:
            self._scan(ns, first=first)
        known = {
            r[0]
            for r in self.store.conn.execute(
                "SELECT namespace_id FROM namespace_stats WHERE pages > 0"
            )
        }
        for ns in sorted(known - set(present)):
            self.watcher.unwatch(ns)
            forget_namespace(self.store, ns)
        self.state.last_scan_at = self.clock()

    def _scan(self, ns: str, *, first: bool) -> ScanReport | None:
        # Watch first, then list: an event racing the scan is applied after it and settled
        # by a stat, so nothing falls between the two.
        if not self.watcher.watch(ns):
            return None
        try:
            report = scan_namespace(self.store, self.layout, ns, now=self.clock, fmt=self.fmt)
        except UnsafePathError as e:  # replaced by a symlink since it was watched
            log.error("namespace dir not scanned", extra={"namespace": ns, "error": str(e)})
            return None
        st = self.state
        st.scans += 1
        st.scan_seconds_total += report.seconds
        st.last_scan_seconds = report.seconds
        if not first and report.drift:
            st.drift_pages += report.drift
            log.info(
                "scan corrected the index",
                extra={"namespace": ns, "added": report.added, "removed": report.removed},
            )
        # At start-up one line per namespace: the progress of a large root's first scan.
        (log.info if first else log.debug)(
            "scanned namespace",
            extra={"namespace": ns, "pages": report.pages, "seconds": round(report.seconds, 3)},
        )
        return report


def _add_lifetime(conn: sqlite3.Connection, ns: str, reads: int, writes: int, now: float) -> None:
    """Add a batch's reads/writes to the namespace's lifetime totals; mark it active."""
    last_read = now if reads else None
    last_write = now if writes else None
    conn.execute(
        "INSERT INTO namespace_stats (namespace_id, page_reads, page_writes, last_read_at,"
        " last_write_at) VALUES (?, ?, ?, ?, ?) ON CONFLICT (namespace_id) DO UPDATE SET"
        " page_reads = page_reads + excluded.page_reads,"
        " page_writes = page_writes + excluded.page_writes,"
        " last_read_at = coalesce(excluded.last_read_at, last_read_at),"
        " last_write_at = coalesce(excluded.last_write_at, last_write_at)",
        (ns, reads, writes, last_read, last_write),
    )
    conn.execute(
        # namespaces.page_reads/page_writes (migration 0001) are no longer kept: nothing read them.
        "UPDATE namespaces SET last_active_at = max(last_active_at, ?) WHERE id = ?",
        (now, ns),
    )
