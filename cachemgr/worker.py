"""The daemon's background threads share one lifecycle: `start()`, `stop(timeout)`, and one way
to fail.

A worker's loop (`_loop`) handles the errors it can survive (a full disk, a corrupt DB moved
aside). Anything else ends the thread, and must not do so silently: the worker records the
error, logs one line naming itself, and calls `on_death` (the daemon answers /readyz with 503
naming the worker, and cachemgr_worker_up{worker=...} turns 0).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)
DeathHandler = Callable[["Worker"], None]


class Worker:
    """One named daemon thread, built (not started) with the worker."""

    def __init__(self, name: str, *, on_death: DeathHandler | None = None) -> None:
        self.name = name  # "index", "gc", "probe", "metrics": the metric label and the /readyz word
        self.error: BaseException | None = None  # set once, by the thread that died of it
        self._on_death = on_death
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"cachemgr-{name}", daemon=True)

    @property
    def up(self) -> bool:
        """False once the thread died of an error (a clean stop is not a death)."""
        return self.error is None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> bool:
        """Ask the loop to end and wait for it; False if it is still running after `timeout`."""
        self._stopping.set()
        self._interrupt()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _interrupt(self) -> None:
        """Cut short whatever the loop waits on, beyond the stop event (a subclass's wake-up)."""

    def _loop(self) -> None:
        raise NotImplementedError

    def _died(self, error: BaseException) -> None:
        """Undo what would look alive after the thread is gone (a subclass's state)."""

    def _main(self) -> None:
        try:
            self._loop()
        except BaseException as e:
            # Undone and logged before the death shows (readyz, cachemgr_worker_up): whoever
            # sees the worker dead must not see its stale state (seen: sglang_up still 1 in CI)
            # nor miss its log line (seen: readyz 503 before the line was written).
            try:
                self._died(e)
            finally:  # (one that raises must not die unseen)
                log.exception("worker died", extra={"worker": self.name, "error": str(e)})
                self.error = e
                if self._on_death is not None:
                    self._on_death(self)
