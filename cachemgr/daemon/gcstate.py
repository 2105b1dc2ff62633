"""What the daemon's GC reads of the running daemon (cachemgr.gc.runner.LiveState): the index's
leadership and write rate, the stores and accesses the index has not applied yet, and the room
left after a run."""

from __future__ import annotations

import os
import sqlite3
import stat
from collections.abc import Iterable
from functools import partial

from cachemgr.daemon import heap
from cachemgr.daemon.backlog import Flight, StoreBacklog
from cachemgr.daemon.index_state import IndexState
from cachemgr.daemon.refresher import Refresher
from cachemgr.daemon.serving import Reader
from cachemgr.daemon.watcher import Watcher
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.check import file_room, room
from cachemgr.gc.execute import InFlight, Unlinking
from cachemgr.gc.pagestore import PageId
from cachemgr.gc.runner import GcRunner, LiveState
from cachemgr.layout import Layout
from cachemgr.ns.quarantine import Quarantine

# Seconds from a store that takes the cache past its high watermark to the first unlink of the
# run it wakes: the inotify thread's lag behind the kernel's queue, the wake, the plan. At full
# speed (5,000-10,000 page stores a second on 2 cores) the cap was passed by 5-17 % between
# runs that each held it, about 100 ms of the writer's pace; with this lead the runs start that
# much earlier (never earlier than the low watermark: policy._bounded), and replays that kept
# up held 0.93-0.96 x the cap (bench/RESULTS.md, "all of session 14 merged").
REACTION = 0.1


class DaemonGcState(LiveState):
    """Built before GC and the index writer, which share it; `refresher`: set once built (it
    renders GC's stats, so it comes after GC)."""

    def __init__(
        self,
        index: IndexState,
        watcher: Watcher,
        model: ChainModel,
        reader: Reader,
        quarantine: Quarantine,
    ) -> None:
        super().__init__(model=model, ready=index.settled, quarantine=quarantine)
        self.index = index
        self.reader = reader
        # Stores not applied yet: GC counts them; past the room left, the watcher wakes GC.
        self.backlog = StoreBacklog(wake=self.woken.set, measure=partial(_size, watcher.layout))
        self.flight = Flight(watcher, model)
        self.refresher: Refresher | None = None

    def may_lead(self) -> bool:
        """GC is led by an index leader: only its watcher wakes GC (watermarks, a CLI purge)."""
        return self.index.leader

    def ahead(self, run_seconds: float) -> int:
        """Written while a run frees room, at the index's measured write rate: during the run,
        and from the store that crosses the watermark to the run's first unlink (REACTION)."""
        return int(self.index.write_rate * (run_seconds + REACTION))

    def pending(self) -> int:
        return self.backlog.bytes()

    def in_flight(self) -> InFlight:
        stored, fresh = self.backlog.unapplied()
        flight = self.flight(stored, fresh)
        queued = set(flight.queued)
        if stored:
            # What the stores not applied yet continue: each stream's last page the model
            # saw (its chain looks like a tail in the model, the stores hang on it).
            queued.update((ns, key) for (ns, *_), key in self.flight.model.last_pages())
        return flight._replace(queued=queued, stored_bytes=self.backlog.page_bytes)

    def gone_early(self, pages: Iterable[PageId]) -> None:
        self.backlog.gone_early(pages)

    def unlinking(self) -> Unlinking:
        """The watcher drops the deletions a run makes (the run forgets them itself)."""
        return self.flight.watcher.own

    def rearm(self, conn: sqlite3.Connection, runner: GcRunner) -> None:
        """What the watcher may see stored before it wakes GC itself (after a batch's check,
        or a run): the bytes left, or a file cap's room in bytes of the largest page seen (the
        backlog counts stores by that size), whichever is less."""
        ahead = runner.ahead()
        left = room(runner.layout, conn, runner.policy, disk_usage=runner.disk_usage, ahead=ahead)
        files = file_room(runner.layout, conn, runner.policy) * max(1, self.backlog.page_bytes)
        self.backlog.rearm(min(left, files))

    def after_run(self, runner: GcRunner) -> None:
        """On GC's thread: the room the run left, so the watcher wakes GC again without waiting
        for the index's next batch; and the heap its plan freed, given back."""
        with self.reader() as conn:
            self.rearm(conn, runner)
        if self.refresher is not None:
            self.refresher.kick()
        heap.trim()  # (well under a ms, without the GIL: bench/RESULTS.md)


def _size(layout: Layout, ns: str, name: str) -> int:
    """A stored page file's size; 0 if it is gone already (or is not a regular file)."""
    try:
        st = os.stat(os.path.join(layout.ns_root, ns, name), follow_symlinks=False)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0
