"""What the index writer knows, for metrics and the API: live counters and flags."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from cachemgr.daemon.events import WatchGaps
from cachemgr.state.index import ScanReport

log = logging.getLogger(__name__)


@dataclass
class Counters:
    """Page reads and writes of one namespace seen since the daemon started."""

    reads: int = 0
    writes: int = 0


@dataclass
class IndexState:
    """What the writer knows, for metrics and the API (read without locks: ints only)."""

    started_at: float = field(default_factory=time.time)  # wall clock: when, for people
    # Uptime is measured on the monotonic clock: the wall clock may step back (NTP, an operator)
    # and make `now - started_at` negative.
    started_monotonic: float = field(default_factory=time.monotonic)
    ready: threading.Event = field(default_factory=threading.Event)  # /readyz, cachemgr_ready
    # GC's runs wait for it: the index matched the disk since the start and GC's model of its
    # pages is built. Ready without it: a restart from the model file scanning what changed
    # while down, or a first start loading the model (`pending` says which).
    settled: threading.Event = field(default_factory=threading.Event)
    pending: str = ""  # what GC waits for while ready and not settled
    counters: dict[str, Counters] = field(default_factory=dict)
    overflows: int = 0
    watch_gaps: WatchGaps = field(default_factory=WatchGaps)  # the watcher's (Indexer)
    scans: int = 0
    scan_seconds_total: float = 0.0
    last_scan_seconds: float = 0.0
    drift_pages: int = 0  # rows added or removed by scans after the first
    events_applied: int = 0
    leader: bool = False  # this process watches and writes the index (see the module doc)
    disk_full: bool = False  # the last write failed for lack of space; retried
    disk_full_retries: int = 0
    write_rate: float = 0.0  # bytes of pages stored per second, smoothed over batches
    _stored: tuple[int, float] | None = None  # (bytes stored so far, when) at the last batch

    @property
    def settling(self) -> bool:
        """Ready, and GC still waits for `pending`."""
        return self.ready.is_set() and not self.settled.is_set()

    def live(self, ready: bool, *, pending: str = "") -> None:
        """Set readiness (settled too unless GC still waits for `pending`), or clear both; in
        an order that never shows `settling` in passing."""
        if not ready:
            self.ready.clear()
            self.settled.clear()
            return
        self.pending = pending
        if not pending:
            self.settled.set()
        self.ready.set()

    def gc_waits(self) -> str:
        """What GC's runs wait for, as /readyz and POST /v1/gc's 503 say it."""
        return f"GC starts after {self.pending or 'the first scan'}"

    def settle(self) -> None:
        """GC may run from now on."""
        self.settled.set()
        self.pending = ""

    def uptime(self) -> float:
        """Seconds since the daemon started, never negative whatever the wall clock does."""
        return time.monotonic() - self.started_monotonic

    def counter(self, ns_id: str) -> Counters:
        got = self.counters.get(ns_id)
        if got is None:
            got = self.counters[ns_id] = Counters()
        return got

    def note_stored(self, total: int, at: float) -> None:
        """After a batch: `total` bytes stored so far, at monotonic time `at`. A smaller total
        is a count started again (the index was rebuilt): no pace from it, never a negative one."""
        if self._stored is not None and at > self._stored[1] and total >= self._stored[0]:
            rate = (total - self._stored[0]) / (at - self._stored[1])
            self.write_rate = 0.5 * self.write_rate + 0.5 * rate
        self._stored = (total, at)

    def record_scan(self, report: ScanReport, *, first: bool) -> None:
        """Count a namespace scan; one that corrected the index after the first says so."""
        self.scans += 1
        self.scan_seconds_total += report.seconds
        self.last_scan_seconds = report.seconds
        ns = report.namespace_id
        if not first and report.drift:
            self.drift_pages += report.drift
            log.info(
                "scan corrected the index",
                extra={"namespace": ns, "added": report.added, "removed": report.removed},
            )
        # At start-up one line per namespace: the progress of a large root's first scan.
        (log.info if first else log.debug)(
            "scanned namespace",
            extra={"namespace": ns, "pages": report.pages, "seconds": round(report.seconds, 3)},
        )
