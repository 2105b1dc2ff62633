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
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from functools import partial
from itertools import islice

from cachemgr.backends import FileFormat
from cachemgr.daemon.events import Event, Kind
from cachemgr.daemon.watcher import ACCESSES, Watcher
from cachemgr.gc.chains import ChainModel, Formats, Stream
from cachemgr.gc.execute import InFlight
from cachemgr.gc.pagestore import NONE, PageId
from cachemgr.gc.plan import lineage

STORES = ACCESSES  # the latest stores GC may take before the index applies them
# Seconds a store is left alone after it was seen: newest first, GC took the first page of a
# request still writing its burst, and the rest of the burst came after it, unusable.
SETTLE = 0.05


class StoreBacklog:
    """Counts page stores seen (inotify thread) and applied (index thread): ints, each written
    by one thread, read by any without a lock; and the latest stores, numbered in the order
    seen, which is the order the index applies them in."""

    def __init__(
        self,
        wake: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        measure: Callable[[str, str], int] = lambda ns, name: 0,
    ) -> None:
        self.wake, self.clock = wake, clock
        self.measure = measure  # (namespace, name) -> the stored file's size (0: gone)
        self.seen = 0  # page stores the watcher queued
        self.applied = 0  # of those, applied to the index
        self.page_bytes = 0  # the largest page file the index has seen stored
        # Bytes that may still be stored before GC must run (set after each batch's check;
        # inf until then, and once GC was woken until the next check).
        self.room = math.inf
        # The latest stores as (number, namespace, name, when seen): those numbered `applied`
        # and up are on disk (or deleted early), and not in the index yet.
        self.recent: deque[tuple[int, str, str, float]] = deque(maxlen=STORES)
        # Stores GC deleted before the index applied them -> their number: not on disk, so not
        # counted, until the index applies them (then the number is below `applied`: dropped).
        # A set pruned by the index's deletions raced it: a store the index applied just
        # before GC noted it stayed "early" and hid a store still on disk (GC then idled).
        self.early: dict[PageId, int] = {}
        self._numbers: dict[PageId, int] = {}  # of the last `unapplied()` (GC's thread)
        self._lock = threading.Lock()  # `early` is pruned by GC's thread and the index's

    def stored(self, ns: str = "", name: str = "") -> None:
        """A page store was queued (on the inotify thread): wake GC once past the room."""
        self.recent.append((self.seen, ns, name, self.clock()))
        self.seen += 1
        if not self.page_bytes:
            # Until the index has measured a page (its first batch, which may take a second
            # to come), the first store stands for them all: at full speed the writer fills
            # a small cap before then, and stores of an unknown size never wake GC.
            self.page_bytes = self.measure(ns, name)
        self._past_room()

    def rearm(self, room: float) -> None:
        """The room left, after a batch's check or a GC run. Stores seen while the run went on
        may be past it already: they wake GC now, as no later store may come to do it."""
        self.room = room
        self._past_room()

    def _unapplied(self) -> int:
        return max(0, self.seen - self.applied - len(self.early))

    def _past_room(self) -> None:
        if self._unapplied() * self.page_bytes > self.room:
            self.room = math.inf  # one wake: the next check after a batch sets it again
            self.wake()

    def done(self, stores: int, page_bytes: int) -> None:
        """The index applied `stores` page stores; its largest page file has `page_bytes`."""
        self.applied += stores
        self.page_bytes = max(self.page_bytes, page_bytes)

    def bytes(self) -> int:
        """Bytes stored that the index does not count yet (an estimate: page files are of one
        size per model, and the largest is taken)."""
        self._prune()
        return self._unapplied() * self.page_bytes

    def unapplied(self) -> tuple[list[PageId], set[PageId]]:
        """The latest stores the index has not applied and GC did not delete, in the order
        stored, and those of them seen less than SETTLE ago (GC's thread)."""
        self._prune()
        applied, settled = self.applied, self.clock() - SETTLE
        recent = self.recent.copy()  # one C call under the GIL: a consistent copy
        # Numbered in the order seen: those not applied are the last ones (a backlog of a few
        # stores must not cost a walk of the whole window at each plan).
        tail = list(islice(reversed(recent), max(0, recent[-1][0] + 1 - applied) if recent else 0))
        tail.reverse()
        self._numbers = {(ns, n): k for k, ns, n, _ in tail if k >= applied}
        fresh = {(ns, n) for k, ns, n, at in tail if k >= applied and at > settled}
        return [p for p in self._numbers if p not in self.early], fresh

    def gone_early(self, pages: Iterable[PageId]) -> None:
        """GC deleted these, of the last `unapplied()`, before the index applied them."""
        with self._lock:
            self.early.update((p, self._numbers[p]) for p in pages if p in self._numbers)

    def _prune(self) -> None:
        applied = self.applied
        with self._lock:
            if any(k < applied for k in self.early.values()):
                self.early = {p: k for p, k in self.early.items() if k >= applied}


def queued_pages(queue: deque[Event], formats: Formats) -> set[PageId]:
    """Pages read or stored whose events the index has not applied yet: used just now,
    though the chain model does not know it (a request reading a prefix goes on to store what
    continues it). GC evicts them and their ancestors last, not never: at full speed that is
    nearly every chain, and the cap wins (cachemgr.gc.value.cap_order). Called on GC's
    thread; the inotify thread keeps appending meanwhile."""
    return _queued(list(queue), _Pages(formats))  # one C call under the GIL: a consistent copy


def _queued(events: list[Event], pages: _Pages) -> set[PageId]:
    # (by index, not unpacking: at full speed a plan walks tens of thousands of events)
    read, write, key = Kind.READ, Kind.WRITE, pages.key
    names = {(e[1], e[2]) for e in events if e[0] is read or e[0] is write}
    return {(ns, key(ns, name)) for ns, name in names}


def take_order(
    events: Sequence[Event], stored: Sequence[PageId], fresh: Collection[PageId], pages: _Pages
) -> list[PageId]:
    """The stores the index has not applied, in the order a cap takes them (the last thing it
    takes: cachemgr.gc.plan._unapplied), from the events it has not applied, in the order seen.

    A request writes its new pages head to tail right after it read its prefix, so on each
    stream (cachemgr.gc.chains.Stream) the stores up to a read of it are one request's burst,
    or more (a writer that only writes), or the first part of one (SGLang's prefetch thread
    reads for the next request while the backup thread writes): they go newest first, so
    what is left of a burst is a usable prefix. A stream's last run of stores may still be
    growing: it goes after them, newest first, without its stores seen just now (its request
    may be writing its head: cut there, the rest it writes is unusable). Taken newest first
    in one list without those seen just now, a backlog of whole requests under load lost its
    oldest request's head while that request's tail, seen with the rest at once, stayed
    behind the hole. A store no event holds any more (the index took it off the queue) goes
    with the last runs."""
    want = set(stored)
    open_: dict[Stream, set[PageId]] = {}  # each stream's run of stores no read followed yet
    closed: set[PageId] = set()
    for kind, ns, name, _, origin in events:
        # (reads are most events at full speed: one closes a run only while one is open)
        if kind is Kind.READ and open_:
            key = pages.key(ns, name)
            run = open_.pop((ns, name[len(key) :], origin), None)
            if run:
                closed |= run
        elif kind is Kind.WRITE and (ns, name) in want:
            key = pages.key(ns, name)
            open_.setdefault((ns, name[len(key) :], origin), set()).add((ns, name))
    newest = list(reversed(stored))
    return [p for p in newest if p in closed] + [
        p for p in newest if p not in closed and p not in fresh
    ]


class Flight:
    """What is in flight that the chain model has not seen, for GC (cachemgr.gc.execute.InFlight):
    at a plan, the pages read or stored in the queue; before each chunk it deletes, each
    stream's run since the plan (`_Runs`: the pages its request read, the page it stored
    last), with their ancestors. A
    request that looked a prefix up (a stat: no event) reads it head to tail right after, so
    the chain it reads is kept from the next chunk on instead of being cut behind the pages
    it already loaded. The run, not the stream's last page: a request seen at page 2 before
    one chunk and at page 5 before the next kept 2 and 5, and a chain whose links the model
    had not learned yet lost 3 and 4 (5 was left unusable behind the hole). What is spared
    yields to a limit that needs it (cachemgr.gc.execute)."""

    def __init__(self, watcher: Watcher, model: ChainModel) -> None:
        self.watcher, self.model = watcher, model

    def __call__(self, stored: Sequence[PageId] = (), fresh: Collection[PageId] = ()) -> InFlight:
        """`stored`: the stores the index has not applied, in the order stored; `fresh`: those
        of them seen just now (StoreBacklog.unapplied). They come back in the order a cap
        takes them (`take_order`)."""
        pages = _Pages(self.model.formats)  # one for the run: its names' keys are kept
        since = _Runs(self.watcher, self.model, pages)
        # One C call each under the GIL (consistent copies), the queue first: an event the
        # index takes from it meanwhile is in what it applies then (or in both: seen twice).
        queue = list(self.watcher.queue)
        events = list(self.watcher.applying) + queue
        order = take_order(events, stored, fresh, pages) if stored else []
        return InFlight(_queued(events, pages), partial(self._keep, since), order)

    def _keep(self, since: _Runs, ns: str, names: Sequence[str], start: int) -> set[str]:
        keys: set[PageId] = set()
        # The model's lock once a chunk, not once a page: the index thread takes it for each
        # event it applies, and a thread waiting for it waited out a batch (the GIL hands it
        # back to the index thread, which takes the lock again first).
        with self.model.lock:
            for pid in reversed(since.reached(ns)):  # tails first: one walk up each chain
                keys |= lineage(self.model, pid, keys)
        if not keys:
            return set()
        planned = since.pages.of(ns, names)
        return {n for _, k in keys if k in planned for i, n in planned[k] if i >= start}


class _Run:
    """What one stream's request in flight uses, as seen since a plan: the pages it read (its
    prefix, head to tail), and the page it stored last (with its ancestors, the pages it
    stored before: a write-only stream's run never ends, and all it stored is not needed)."""

    def __init__(self) -> None:
        self.read: dict[str, None] = {}  # (a dict: in the order read)
        self.slots: set[int] = set()  # their slots in the model (a look-up each, not a key)
        self.stored: str | None = None  # a store came after the reads: the next read ends it

    def pages(self) -> list[str]:
        return [*self.read, self.stored] if self.stored is not None else list(self.read)


class _Runs:
    """Each stream's run of pages accessed since a plan, brought up to date before each chunk
    from the accesses that came since the previous one only: at full speed tens of thousands
    come during a run, and parsing all of them again for each chunk of 256 was most of a
    run's time (the writer outran it). A run ends (the stream's next request began) at a read
    after a store, a page read again, or a read of a page whose predecessor the model knows
    and the run does not hold."""

    def __init__(self, watcher: Watcher, model: ChainModel, pages: _Pages) -> None:
        self.watcher, self.model, self.pages = watcher, model, pages
        self.mark = watcher.accessed
        self.runs: dict[Stream, _Run] = {}
        # The newest access taken: the ones after it are new (an access is its event object,
        # which this reference keeps alive: its id is never another's). A count alone could
        # not say which they are: appends race it, and one taken twice reads as read again.
        self.last: Event | None = watcher.accesses[-1] if watcher.accesses else None

    def reached(self, ns: str) -> list[PageId]:
        """The pages of `ns` the streams' runs hold, in the order accessed."""
        if self.watcher.accessed != self.mark:
            self.mark = self.watcher.accessed
            # copy() is one C call under the GIL: a consistent copy (a reversed() iterator made
            # in one call and consumed in the next fails once the inotify thread appends)
            for event in self._new(self.watcher.accesses.copy()):
                self._take(event)
        return [(ns, k) for (s_ns, *_), run in self.runs.items() if s_ns == ns for k in run.pages()]

    def _new(self, accesses: deque[Event]) -> list[Event]:
        """The accesses after the newest one taken, oldest first (all of them if it is gone
        from the window: a run's worth at full speed came in between)."""
        new: list[Event] = []
        for event in reversed(accesses):
            if event is self.last:
                break
            new.append(event)
        if new:
            self.last = new[0]
        return new[::-1]

    def _take(self, event: Event) -> None:
        kind, ns, name, _, origin = event
        key = self.pages.key(ns, name)
        stream = (ns, name[len(key) :], origin)
        run = self.runs.get(stream)
        if kind is Kind.WRITE:
            if run is None:
                run = self.runs[stream] = _Run()
            run.stored = key
            return
        at = self.model.store.find(ns, key)  # (under the model's lock: Flight._keep)
        if run is None or self._ends(run, key, at):
            run = self.runs[stream] = _Run()
        run.read[key] = None
        run.slots.add(at)

    def _ends(self, run: _Run, key: str, at: int) -> bool:
        """Whether a read of `key` (the model's slot `at`) begins the stream's next request:
        a read after a store, a page read again, or one whose predecessor the model knows and
        the run did not read."""
        if run.stored is not None or key in run.read:
            return True
        pred = self.model.store.pred[at] if at != NONE else NONE
        return pred != NONE and pred not in run.slots


class _Pages:
    """Page keys of file names, by their namespace's format (read once), each name's once (a
    run sees the same hot pages read thousands of times, and its queue holds them too), and
    of a step's names by key (computed once per step)."""

    def __init__(self, formats: Formats) -> None:
        self.formats = formats
        self._fmts: dict[str, FileFormat] = {}
        self._steps: dict[int, dict[str, list[tuple[int, str]]]] = {}
        self._keys: dict[tuple[str, str], str] = {}

    def key(self, ns: str, name: str) -> str:
        got = self._keys.get((ns, name))
        if got is None:
            fmt = self._fmts.get(ns) or self._fmts.setdefault(ns, self.formats(ns))
            got = name[: fmt.key_len(name) or len(name)]  # (a nested page's key is its path)
            self._keys[ns, name] = got
        return got

    def of(self, ns: str, names: Sequence[str]) -> dict[str, list[tuple[int, str]]]:
        """key -> [(position, name)] of a step's names."""
        got = self._steps.get(id(names))
        if got is None:
            got = self._steps[id(names)] = {}
            for i, name in enumerate(names):
                got.setdefault(self.key(ns, name), []).append((i, name))
        return got
