"""The metrics refresher: reads what /metrics shows from the DB and the disk, off the scrape.

A scrape that ran SQL and read manifests itself would wait for the GIL at each of those calls
while GC plans or the index applies a mass of events (one thread switch interval each), which
is where its slow tail came from. The refresher takes the snapshot every `interval` seconds and
soon after a change it is told of, so a scrape only renders numbers already in memory; what
it shows is at most `interval` old.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable

from cachemgr.errors import CachemgrError, StateUnavailable
from cachemgr.ns.quarantine import is_denied
from cachemgr.worker import DeathHandler, Worker

log = logging.getLogger(__name__)

REFRESH = 1.0  # seconds at most between two snapshots


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
    ) -> None:
        super().__init__("metrics", on_death=on_death)
        self.refresh, self.interval, self.gap = refresh, interval, gap
        self._kick = threading.Event()
        self._denied = False  # the last refresh was refused access (said once)

    def kick(self) -> None:
        """Something the metrics show changed (a batch applied, a namespace gone)."""
        self._kick.set()

    def _interrupt(self) -> None:
        self._kick.set()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._kick.clear()
            try:
                self.refresh()
                self._denied = False
            except (OSError, StateUnavailable) as e:  # (the reader's word for a denied one)
                if isinstance(e, OSError) and not is_denied(e):
                    log.exception("metrics refresh failed")
                elif not self._denied:  # an unreadable root: the index says so too, once
                    log.warning(
                        "metrics refresh denied; the last snapshot stays", extra={"error": str(e)}
                    )
                    self._denied = True
            except (CachemgrError, sqlite3.Error):
                # A locked or full DB, a vanished dir: the last snapshot stays, the next try
                # comes at the interval.
                log.exception("metrics refresh failed")
            self._kick.wait(self.interval)
            self._stopping.wait(self.gap)
