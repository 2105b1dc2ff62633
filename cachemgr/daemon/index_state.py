"""What the index writer knows, for metrics and the API: live counters and flags."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


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
    drift_pages: int = 0  # rows added or removed by scans after the first
    events_applied: int = 0
    leader: bool = False  # this process watches and writes the index (see the module doc)
    disk_full: bool = False  # the last write failed for lack of space; retried
    disk_full_retries: int = 0

    def counter(self, ns_id: str) -> Counters:
        got = self.counters.get(ns_id)
        if got is None:
            got = self.counters[ns_id] = Counters()
        return got
