"""Paced mass work behind the limits: how a GC run deletes what holds no cap or floor (a
purge's drain of millions of files, stale temps, dropped namespaces) once it has deleted what
does (cachemgr.gc.execute), and how the daemon's own runs give way to a limit crossed
meanwhile (cachemgr.gc.runner)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

from cachemgr.fs.deletion import Pacer


class Behind(NamedTuple):
    """How a daemon's run carries out the steps that hold no limit, behind those that do
    (execute_gc): `done` is told when those are, and the others go at `pacer`'s rate until
    `stop` (a limit crossed meanwhile: the next run keeps it, then goes on with them)."""

    pacer: Pacer
    stop: Callable[[], bool]
    done: Callable[[], None]


class GiveWay:
    """A run's paced mass work (a purge's drain of millions of files) yields to a limit
    crossed meanwhile (GC woken), and the loop runs again at once. The runs that go on with it
    share one pacer, owed at most one batch for the time between them: until a run has
    deleted something it takes a batch once the pace allows (napping till then, unless woken
    first: then it yields), and once it has, it yields at the next batch if woken. So the
    drain goes on at its rate whatever wakes GC (yielding before its first batch starved it),
    the rate holds across runs (a new pacer each run let 256 files go before its first nap: 4x
    a rate of 100), and a limit waits for one batch's unlinks at most, never a nap (a nap of
    2.6 s let a 200-page cap reach 632 pages; yielding after 0.5 s, 306)."""

    def __init__(self, woken: threading.Event) -> None:
        self.woken = woken
        self.pacer: Pacer | None = None
        self.at = 0  # the pacer's count when the run began
        self.yielded = False

    def behind(self, rate: float | None, done: Callable[[], None]) -> Behind:
        """What one run does behind the limits: the last run's pacer if that run yielded."""
        if not self.yielded or self.pacer is None or self.pacer.rate != rate:
            self.pacer = Pacer(rate=rate, sleep=self.nap)
        self.pacer.owe_at_most(self.pacer.batch)
        self.at, self.yielded = self.pacer.count, False
        return Behind(self.pacer, self.stop, done)

    def stop(self) -> bool:
        pacer = self.pacer
        if pacer is not None and pacer.count == self.at:  # none deleted yet by this run
            wait = pacer.due()
            self.yielded = wait > 0 and self.woken.wait(wait)
        else:
            self.yielded = self.woken.is_set()
        return self.yielded

    def nap(self, seconds: float) -> None:
        self.woken.wait(seconds)  # woken: `stop` yields before the next batch
