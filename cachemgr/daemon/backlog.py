"""What the watcher has seen and the index (and its chain model) not yet: for GC.

The index applies events in batches (every `batch_interval`, then however long the batch takes:
a full-speed SGLang reads ten times more pages than it stores, and each read is applied too),
so what it counts lags the disk by a batch or more. Page stores in that lag are on disk
already: GC counts them against the cap (`StoreBacklog`, `pending`), and the inotify thread
wakes GC as soon as they would take the cache past its high watermark, instead of the index
noticing after its next batch. Pages read or stored in that lag, or while a run deletes, are in
use though the chain model does not know it yet (`Flight`): GC leaves them and their ancestors.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from itertools import islice

from cachemgr.backends import FileFormat
from cachemgr.daemon.events import Event, Kind
from cachemgr.daemon.watcher import Watcher
from cachemgr.gc.chains import ChainModel, Formats
from cachemgr.gc.execute import InFlight
from cachemgr.gc.pagestore import PageId
from cachemgr.gc.plan import lineage


class StoreBacklog:
    """Counts page stores seen (inotify thread) and applied (index thread): ints, each written
    by one thread, read by any without a lock."""

    def __init__(self, wake: Callable[[], None] = lambda: None) -> None:
        self.wake = wake
        self.seen = 0  # page stores the watcher queued
        self.applied = 0  # of those, applied to the index
        self.page_bytes = 0  # the largest page file the index has seen stored
        # Bytes that may still be stored before GC must run (set after each batch's check;
        # inf until then, and once GC was woken until the next check).
        self.room = math.inf

    def stored(self) -> None:
        """A page store was queued (on the inotify thread): wake GC once past the room."""
        self.seen += 1
        self._past_room()

    def rearm(self, room: float) -> None:
        """The room left, after a batch's check or a GC run. Stores seen while the run went on
        may be past it already: they wake GC now, as no later store may come to do it."""
        self.room = room
        self._past_room()

    def _past_room(self) -> None:
        if (self.seen - self.applied) * self.page_bytes > self.room:
            self.room = math.inf  # one wake: the next check after a batch sets it again
            self.wake()

    def done(self, stores: int, page_bytes: int) -> None:
        """The index applied `stores` page stores; its largest page file has `page_bytes`."""
        self.applied += stores
        self.page_bytes = max(self.page_bytes, page_bytes)

    def bytes(self) -> int:
        """Bytes stored that the index does not count yet (an estimate: page files are of one
        size per model, and the largest is taken)."""
        return max(0, self.seen - self.applied) * self.page_bytes


def queued_pages(queue: deque[Event], formats: Formats) -> set[PageId]:
    """Pages read or stored whose events the index has not applied yet: used just now,
    though the chain model does not know it (a request reading a prefix goes on to store what
    continues it). GC evicts them and their ancestors last, not never: at full speed that is
    nearly every chain, and the cap wins (cachemgr.gc.value.cap_order). Called on GC's
    thread; the inotify thread keeps appending meanwhile."""
    events = list(queue)  # one C call under the GIL: a consistent copy
    names = {(ns, name) for kind, ns, name, _ in events if kind is Kind.READ or kind is Kind.WRITE}
    pages = _Pages(formats)
    return {(ns, pages.key(ns, name)) for ns, name in names}


class Flight:
    """What is in flight that the chain model has not seen, for GC (cachemgr.gc.execute.InFlight):
    at a plan, the pages read or stored in the queue; before each chunk it
    deletes, the last page each stream read or stored since the plan, with its ancestors. A
    request that looked a prefix up (a stat: no event) reads it head to tail right after, so
    the chain it reads is kept from the next chunk on instead of being cut behind the pages
    it already loaded. One lineage per stream, not one per page read."""

    def __init__(self, watcher: Watcher, model: ChainModel) -> None:
        self.watcher, self.model = watcher, model

    def __call__(self) -> InFlight:
        mark, pages = self.watcher.accessed, _Pages(self.model.formats)
        queued = queued_pages(self.watcher.queue, self.model.formats)
        return InFlight(queued, partial(self._keep, mark, pages))

    def _keep(
        self, mark: int, pages: _Pages, ns: str, names: Sequence[str], start: int
    ) -> set[str]:
        seen = self.watcher.accessed - mark
        if seen <= 0:
            return set()
        # One C call under the GIL (a consistent copy); a few older ones too: appends race the
        # count, and an access counted twice only keeps more.
        recent = list(islice(reversed(self.watcher.accesses), seen + 64))
        planned = pages.of(ns, names)
        reached = pages.last(((n_ns, name) for n_ns, name in reversed(recent) if n_ns == ns))
        keys: set[str] = set()
        for pid in reached:
            keys |= {k for _, k in lineage(self.model, pid)}
        return {n for k in keys if k in planned for i, n in planned[k] if i >= start}


class _Pages:
    """Page keys of file names, by their namespace's format (read once), and of a step's names
    by key (computed once per step)."""

    def __init__(self, formats: Formats) -> None:
        self.formats = formats
        self._fmts: dict[str, FileFormat] = {}
        self._steps: dict[int, dict[str, list[tuple[int, str]]]] = {}

    def key(self, ns: str, name: str) -> str:
        fmt = self._fmts.get(ns) or self._fmts.setdefault(ns, self.formats(ns))
        return name[: fmt.key_len(name) or len(name)]  # (a nested page's key is its path)

    def last(self, accesses: Iterable[tuple[str, str]]) -> set[PageId]:
        """The page each stream (namespace, name after the key) accessed last, of these
        (namespace, name) accesses, oldest first."""
        out: dict[tuple[str, str], str] = {}
        for ns, name in accesses:
            key = self.key(ns, name)
            out[ns, name[len(key) :]] = key
        return {(ns, key) for (ns, _), key in out.items()}

    def of(self, ns: str, names: Sequence[str]) -> dict[str, list[tuple[int, str]]]:
        """key -> [(position, name)] of a step's names."""
        got = self._steps.get(id(names))
        if got is None:
            got = self._steps[id(names)] = {}
            for i, name in enumerate(names):
                got.setdefault(self.key(ns, name), []).append((i, name))
        return got
