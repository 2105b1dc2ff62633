"""GC's own deletions of pages, which the watcher drops instead of queueing them for the index.

A run that holds a limit drops the pages' index rows with its audit row, chunk by chunk, and
the live chain model forgets them then too (cachemgr.gc.execute.Recorded): the IN_DELETE the
kernel then reports for each is no news. Queued, each cost the index a stat (which finds
nothing), a row delete (of no row) and a model look-up, and every plan's copy of the queue
grew by it: at full speed a third of all page events, and of an eviction of a million pages
nearly all of them (bench/RESULTS.md).

GC says which names it is about to unlink before each chunk (so an event read while the
unlinks run is known), then which it did unlink; the others (refused, too young, gone already)
are taken back, so a deletion someone else makes later is news again. One of theirs the watcher
took before GC said so (someone deleted a page GC had just refused as too young, while the
chunk ran) was someone else's: it is told to `lost` (the watcher queues it after all).

A page the engine stores again after GC's unlink (a request recomputed the prefix GC just
evicted) and before GC records its chunk is on disk, and the index may apply that store first:
the watcher says so (`stored`, for a name whose deletion it took), and the record keeps those
rows and pages (`again`). The kernel reports a dir's events in order, so a store the watcher
reads after it took the deletion came after the unlink.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence

from cachemgr.gc.pagestore import PageId

# Names expected at most. Their events come within a kernel queue's worth (16,384 by default)
# after the unlinks, so a dict this full holds names whose events were lost (an overflow, a
# namespace purged during the run): it starts again, and those deletions are simply applied.
MOST = 1 << 16
# Seconds after GC said so that a deletion is still taken for its own. An event comes well
# within it, unless no watch saw the unlink (a dir unwatched for a moment, as the index thread
# does after a purge that an init followed at once, or past the watch limit): then none comes,
# and the next deletion of that name by anyone else (the engine stores a prefix again under
# the same names) must not be dropped. An event later than this is queued: it costs the
# index a stat, never a row.
STALE = 60.0


class OwnDeletions:
    """(namespace, name below its dir) of each page file a GC run is unlinking; dict operations
    are atomic under the GIL: GC's thread adds and takes back, the inotify thread takes (and
    marks the pages stored again, under a lock)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._names: dict[PageId, float] = {}  # -> when GC said it would unlink it
        # Told, on GC's thread, of names of `ns` whose deletion was taken for GC's though GC
        # did not unlink them (cachemgr.daemon.watcher: queued as deleted, which the index
        # checks with a stat).
        self.lost: Callable[[str, list[str]], None] = lambda ns, names: None
        # Deletions the watcher took as GC's, until GC records them: whether the engine
        # stored the page again since. (A lock: `stored` on the inotify thread must not mark
        # a name `again` already let go of, or a later record of that name would keep its row.)
        self._taken: dict[PageId, bool] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._names)

    def expect(self, ns: str, names: Sequence[str]) -> None:
        """GC is about to unlink these files of `ns`."""
        if len(self._names) + len(names) > MOST:
            self._names.clear()
        keys = [(ns, n) for n in names]
        self._names.update(dict.fromkeys(keys, self.clock()))
        if self._taken:  # (a deletion of an earlier run no record let go of: not this one's)
            with self._lock:
                for key in keys:
                    self._taken.pop(key, None)

    def settle(self, ns: str, names: Sequence[str], deleted: Collection[str]) -> None:
        """Of the `names` GC meant to unlink, it unlinked `deleted`: the rest are not its own.
        (The pop decides, atomically, against `take` on the inotify thread: a name the
        watcher took already is told to `lost`; one taken back here is news when it comes.)"""
        lost = [n for n in names if n not in deleted and self._names.pop((ns, n), None) is None]
        if lost:
            self.lost(ns, lost)

    def take(self, ns: str, name: str) -> bool:
        """On the inotify thread: whether this page file's deletion is one GC made (it is
        expected no more)."""
        at = self._names.pop((ns, name), None)
        if at is None or self.clock() - at >= STALE:
            return False
        if len(self._taken) >= MOST:  # (records let go of them: these outlived their run)
            with self._lock:
                self._taken.clear()
        self._taken[ns, name] = False
        return True

    def stored(self, ns: str, name: str) -> None:
        """On the inotify thread, for a page file stored: if GC's deletion of it was taken
        and not recorded yet, the page is back (`again`)."""
        if self._taken:
            with self._lock:
                if (ns, name) in self._taken:
                    self._taken[ns, name] = True

    def again(self, ns: str, names: Sequence[str]) -> set[str]:
        """On GC's thread, as it records these names gone: those stored again since their
        unlink. They are let go of either way."""
        if not self._taken:
            return set()
        with self._lock:
            return {n for n in names if self._taken.pop((ns, n), False)}

    def forget(self, ns: str) -> None:
        """The namespace's dir left <root>/ns (a purge): its files' events will not come."""
        # (over a copy, made in one C call: GC's thread adds and takes back names meanwhile,
        # and a dict that changes size under a loop over it raises, on the inotify thread)
        for key in [k for k in list(self._names) if k[0] == ns]:
            self._names.pop(key, None)
        with self._lock:
            for key in [k for k in list(self._taken) if k[0] == ns]:
                self._taken.pop(key, None)

    def clear(self) -> None:
        """Events were lost: whatever was expected may never come."""
        self._names.clear()
        with self._lock:
            self._taken.clear()
