"""The metrics refresher: reads what /metrics shows from the DB and the disk, off the scrape.

A scrape that ran SQL and read manifests itself would wait for the GIL at each of those calls
while GC plans or the index applies a mass of events (one thread switch interval each), which
is where its slow tail came from. The refresher takes the snapshot every `interval` seconds and
soon after a change it is told of, so a scrape only renders numbers already in memory; what
it shows is at most `interval` old.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import threading
import time
from collections.abc import Callable

from cachemgr.errors import CachemgrError, StateUnavailable, UnsafePathError
from cachemgr.ns.quarantine import is_denied
from cachemgr.worker import DeathHandler, Worker

log = logging.getLogger(__name__)

REFRESH = 1.0  # seconds at most between two snapshots
# Seconds between two lines about refreshes failing the same way: one a second filled the log
# (<root>/ns replaced by a symlink failed every refresh; the index says why, once).
WARN_EVERY = 60.0


class Refresher(Worker):
    """Calls `refresh` every `interval`, and soon after `kick()` (at most once per `gap`,
    however often it is kicked)."""

    def __init__(
        self,
        refresh: Callable[[], object],
        *,
        interval: float = REFRESH,
        gap: float = 0.05,
        on_death: DeathHandler | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__("metrics", on_death=on_death)
        self.refresh, self.interval, self.gap = refresh, interval, gap
        self.clock = clock
        self._kick = threading.Event()
        self._denied = False  # the last refresh was refused access (said once)
        self._warned = -math.inf  # when a failure was last logged
        self._failures = 0  # refreshes failed since the last one that worked

    def kick(self) -> None:
        """Something the metrics show changed (a batch applied, a namespace gone)."""
        self._kick.set()

    def _interrupt(self) -> None:
        self._kick.set()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._kick.clear()
            self._refresh_once()
            self._kick.wait(self.interval)
            self._stopping.wait(self.gap)

    def _refresh_once(self) -> None:
        """One snapshot; a failed one leaves the last in place, and is said (see _failed)."""
        try:
            self.refresh()
        except (OSError, StateUnavailable) as e:  # (the reader's word for a denied one)
            if isinstance(e, OSError) and not is_denied(e):
                self._failed(e, trace=False)  # a vanished dir, an I/O error
            elif not self._denied:  # an unreadable root: the index says so too, once
                log.warning(
                    "metrics refresh denied; the last snapshot stays", extra={"error": str(e)}
                )
                self._denied = True
            return
        except UnsafePathError as e:  # ns/ replaced by a symlink: the index holds the root aside
            self._failed(e, trace=False)
            return
        except (CachemgrError, sqlite3.Error) as e:
            # A locked or full DB, a vanished dir: the last snapshot stays, the next try
            # comes at the interval.
            self._failed(e, trace=True)
            return
        self._denied = False
        if self._failures:
            log.warning("metrics refresh works again", extra={"failures": self._failures})
        self._failures, self._warned = 0, -math.inf

    def _failed(self, error: Exception, *, trace: bool) -> None:
        """At most one line each WARN_EVERY, with how many failed since the last line; the
        traceback only for what is not an expected state of the disk (`trace`)."""
        self._failures += 1
        now = self.clock()
        if now - self._warned < WARN_EVERY:
            return
        self._warned = now
        log.error(
            "metrics refresh failed; the last snapshot stays",
            extra={"error": f"{type(error).__name__}: {error}", "failures": self._failures},
            exc_info=error if trace else None,
        )
