"""Prefix chains learned from the order of page accesses, and what is known of each page's use.

SGLang loads the longest *contiguous* prefix of a request's pages: a page is useful only while
every earlier page of its chain is on disk. The file names do not say which page comes before
which, but the access stream does. One I/O thread per rank reads a request's hits head → tail
(`batch_get`) and the backup thread writes its new pages in order right after, so:

* a page **written** right after page P of the same stream (namespace, file suffix: one
  rank's files, and node: a fleet's leader hears each other node's accesses in summaries,
  interleaved with its own) continues P only within one request's own write burst: P was
  the last page of its read prefix (SGLang reads the prefix, then writes the tail), or a
  page of that burst stored less than BURST_GAP before it. Consecutive stores of different
  requests are no chain (a write-only stream of unique prompts once became one chain whose
  newest pages, in flight, held every page behind them); a store after a pause is a vote
  only, which the next read of the page behind it confirms;
* a page **read** right after P is evidence for P; a link that keeps losing to other evidence
  is dropped (a majority vote with a small counter), and a new one is made only when two
  requests in a row (contrary reads of one stream) agree on it. So an order mixed up by
  concurrent requests is repaired as reads arrive, and a chain's first page, read (or
  written) right after whatever request came before, stays unlinked: that evidence is
  rarely the same twice;
* a link that would close a cycle is refused (the shared system prompt, an ancestor of every
  chain, never gets a session's page as its predecessor).

A page with no known predecessor is a chain of its own: it is still evicted by its use. The
model knows only pages the index holds; its clock is the index's access sequence, never the
wall clock, so a trace replayed at any request rate teaches it the same chains and the same
order (cachemgr.gc.value). The daemon keeps one live model (fed by cachemgr.daemon.page_events);
a CLI run builds one from the index (`load`), where the learned links are stored. Its pages
live in a compact store (cachemgr.gc.pagestore): ~44 bytes a page, not a Python object each.
"""

from __future__ import annotations

import sqlite3
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

from cachemgr.backends import FileFormat
from cachemgr.formats import DEFAULT_FORMAT
from cachemgr.gc.adapt import Adaptive
from cachemgr.gc.history import History
from cachemgr.gc.pagestore import GHOST, NONE, Page, PageId, PageStore, PagesView
from cachemgr.state import pages_sql

CONFIDENCE_MAX = 3  # agreeing reads a link may bank against later contrary evidence
# Buckets of the key table a sweep passes in the time one page's drop takes (~0.08 and ~2.7 µs,
# bench/RESULTS.md): a namespace of fewer slots than the table over this is forgotten a page
# at a time, a larger one in one sweep (ChainModel.forget).
SWEEP_PER_DROP = 32
CYCLE_WALK = 100_000  # ancestors walked at most to refuse a cycle (chains are far shorter)
# Accesses (of any page) since a page's last use while the daemon deems it in flight: its request
# may still write pages continuing it (or another rank's file of it), stranded if it went. In
# accesses (any rate), and only for IN_FLIGHT_SECONDS: when the writer stops, none is in flight.
IN_FLIGHT = 1024
IN_FLIGHT_SECONDS = 2.0
# Seconds between two stores of one stream within which the second continues the first: one
# request's `batch_set` writes its pages back to back; a request's next page after a longer
# pause, or another request's, is not linked by its store. Between the two mtimes (when each
# file's last write() began), or from the first's rename (ctime) to the second's birth time:
# SGLang's 1 MiB pages are 3-13 ms apart by mtime on a quiet 2-core box, 8 MiB pages 22-33 ms
# (each takes that long to write), yet each one's temp file is made within the kernel's 4 ms
# timestamp tick of the last one's rename (bench/bench_bursts.py).
BURST_GAP = 0.005
Formats = Callable[[str], FileFormat]  # a namespace's file format
# One writer's access stream: (namespace, file suffix (one rank's files), origin (whose
# inotify saw it: cachemgr.daemon.events.LOCAL, or the fleet node whose summary carried it))
Stream = tuple[str, str, str]
DIRTY_MAX = 65_536  # pages changed between two orders past which all segments are walked again


class Written(NamedTuple):
    """When a page file was written, by the writer's clock (its file's times), and its size."""

    last: float  # its last write() began (mtime)
    began: float | None = None  # its (temp) file was made (birth time; None: not kept)
    placed: float | None = None  # it was renamed into place (ctime; None: at `last`)
    size: int = 0  # bytes (0: not known yet, the index tells it later)


class ChainModel:
    """Every indexed page, its learned chain link, and how many children it has on disk.

    Thread-safe: the index thread observes, the GC thread reads an order (`lock`).
    """

    def __init__(
        self,
        formats: Formats = lambda ns: DEFAULT_FORMAT,
        *,
        in_flight: int = 0,
        key_dir: Path | None = None,
    ) -> None:
        self.formats = formats  # what the names in a namespace's dir mean (its engine's format)
        self.in_flight = in_flight  # the last accesses whose pages GC leaves alone
        self.store = PageStore(key_dir)  # (its keys in a file there: None, the temp dir)
        self.history = History()  # evicted chain heads, for when their chain comes back
        self.adapt = Adaptive()  # which eviction order to follow (cachemgr.gc.value)
        self.clock = 0  # the largest access sequence seen
        self._prev: dict[Stream, str] = {}  # -> the last page key
        # -> when its last store was written and renamed into place (mtime, ctime), if it was a
        # store (a read: absent)
        self._stored: dict[Stream, tuple[float, float]] = {}
        # The eviction order's segments as of its last run (cachemgr.gc.value): leaf slot ->
        # (top slot, latest use, latest wall-clock use), and the slots changed since.
        self.segments: dict[int, tuple[int, int, float]] = {}
        self.dirty: set[int] = set()
        self.lock = threading.RLock()

    def close(self, timeout: float) -> bool:
        """Let the file of the pages' keys go (the model is not used after this), unless a
        thread still holds the model after `timeout` seconds: False then."""
        if not self.lock.acquire(timeout=timeout):
            return False
        try:
            self.store.keys.close()
        finally:
            self.lock.release()
        return True

    @property
    def keys_in_memory(self) -> int:
        """Page keys held in memory because their file (in `key_dir`) cannot be written; read
        without the lock (a scrape's), so as of a moment ago."""
        return self.store.keys.in_memory

    @property
    def pages(self) -> Mapping[PageId, Page]:
        """A read-only view of the pages on disk (copies, for tests and reports)."""
        return PagesView(self.store, self.lock)

    # -- building -----------------------------------------------------------------------------

    def add(
        self,
        ns: str,
        name: str,
        key_len: int,
        size: int,
        *,
        seq: int,
        at: float,
        pred: str | None = None,
        born: int | None = None,
    ) -> None:
        """Index one file (a page's first file creates the page; a known page keeps its use)."""
        with self.lock:
            s = self.store.ensure(ns, name[:key_len])
            self._page(s, seq, at, pred, born, False)
            self._placed(s, name[key_len:], size, seq, at)
            self.clock = max(self.clock, seq)

    def _placed(self, s: int, suffix: str, size: int, seq: int, at: float) -> None:
        """Page `s` has the file `suffix` of `size` bytes, stored at `seq` (`at`)."""
        self._file(s, sys.intern(suffix), size, seq, at, 0)
        if not self.store.kids[s]:
            self.store.add_leaf(s)  # (a no-op for a page that was a leaf already)

    def add_indexed(self, ns: str, row: pages_sql.ChainRow) -> None:
        """`add` for a file as the index holds it (the row a load reads: no copy of it is made),
        with its read count; its link comes from the index, where no link closes a cycle."""
        name, key_len, size, at, seq, reads, pred, born = row
        with self.lock:
            s = self._page(self.store.ensure(ns, name[:key_len]), seq, at, pred, born, True)
            self._file(s, sys.intern(name[key_len:]), size, seq, at, reads)
            if not self.store.kids[s]:
                self.store.add_leaf(s)
            if seq > self.clock:
                self.clock = seq

    def _page(
        self, s: int, seq: int, at: float, pred: str | None, born: int | None, trusted: bool
    ) -> int:
        """Slot `s` as a page with a file on disk (a ghost or a new key starts as a page now),
        linked to `pred` if it has no link yet. `trusted`: `pred` comes from the index, where
        no link closes a cycle."""
        st = self.store
        if st.files[s] == GHOST:
            st.start(s, seq if born is None else born, seq, at)
            self._link(s, pred, trusted)
            self.history.returned(st, s)
        elif st.pred[s] == NONE and pred is not None:
            self._link(s, pred, trusted)
        return s

    def _file(self, s: int, suffix: str, size: int, seq: int, at: float, reads: int) -> None:
        """Page `s` has the file `suffix` of `size` bytes, used at `seq` (`at`), read `reads`
        times (the index's count; a live event's: 0, the model counts its reads itself)."""
        st = self.store
        old = st.file_sets[st.files[s]]
        new = (*(f for f in old if f[0] != suffix), (suffix, size)) if old else ((suffix, size),)
        st.files[s] = st.file_set(new)
        if reads > st.reads[s]:
            st.put("reads", s, reads)
        if seq > st.last[s]:
            st.used(s, seq, at)
        self._mark(s)

    @classmethod
    def from_index(
        cls, conn: sqlite3.Connection, ns_ids: Iterable[str], key_dir: Path | None = None
    ) -> ChainModel:
        """A model of these namespaces as the index holds them (its keys in a file in
        `key_dir`)."""
        model = cls(key_dir=key_dir)
        for ns in ns_ids:
            model.load(conn, ns)
        return model

    def load(self, conn: sqlite3.Connection, ns: str) -> None:
        """(Re)build a namespace's pages from the index: after a scan changed it, at start-up,
        or for a one-off GC run. The order of accesses within it is not stored: only links."""
        add = self.add_indexed
        with self.lock:
            self.forget(ns)
            self.store.reserve(pages_sql.file_count(conn, ns))  # no table doubling as it loads
            for row in pages_sql.chain_rows(conn, ns):
                add(ns, row)

    def remove(self, ns: str, names: Iterable[tuple[str, int]]) -> None:
        """Forget files (name, key_len) that are gone; a page goes with its last file."""
        st = self.store
        with self.lock:
            for name, key_len in names:
                s = st.find(ns, name[:key_len])
                if not st.present(s):
                    continue
                suffix = name[key_len:]
                files = tuple(f for f in st.file_sets[st.files[s]] if f[0] != suffix)
                st.files[s] = st.file_set(files)
                if not files:
                    self.history.evicted(st, s)
                    self._drop(s)

    def forget_gone(self, ns: str, names: Iterable[str], fmt: FileFormat | None = None) -> None:
        """Forget these files of `ns` that GC deleted, before the watcher says so (`fmt`: the
        format its dir follows, if the caller knows it: else read from its manifest)."""
        key_len = (fmt or self.formats(ns)).key_len  # (a nested page's key is its path)
        self.remove(ns, [(n, key_len(n) or len(n)) for n in names])

    def forget(self, ns: str) -> None:
        """Forget a whole namespace (its dir is gone), under the model's lock (GC and the
        index wait). One that holds every slot (the one model's dir, purged) goes with the
        store. A small one beside others goes a page at a time (a sweep of a table of ten
        million pages takes seconds), the others' cached segments kept unless more than
        DIRTY_MAX pages change; a larger one in one sweep of the store's key table (a slot at
        a time, 9M slots took most of a minute), and the orders walk every segment again
        next (slots of the others' cached ones may be reused)."""
        with self.lock:
            n = self.store.ns_num.get(ns)
            if n is not None:
                self._forget_slots(ns, n)
            self._prev = {s: k for s, k in self._prev.items() if s[0] != ns}
            self._stored = {s: t for s, t in self._stored.items() if s[0] != ns}

    def _forget_slots(self, ns: str, n: int) -> None:
        st = self.store
        slots, every = st.ns_slots[n], st.top - len(st.freed)
        if slots < every and slots * SWEEP_PER_DROP < len(st.table):
            for s in list(st.slots(ns)):
                self._drop(s)
            st.forget_ns(ns)
            return
        if slots == every:
            st.clear()  # (in place: an order waiting for the lock holds this store)
        else:
            st.drop_ns(ns)
        self.segments.clear()
        self.dirty.clear()

    def _drop(self, s: int) -> None:
        st = self.store
        st.drop_leaf(s)
        st.files[s], st.count = GHOST, st.count - 1
        st.votes.drop(s)  # (only a page on disk holds one)
        st.ns_pages[st.ns[s]] -= 1
        if st.pred[s] != NONE:
            self._unkid(s, st.pred[s])
            st.pred[s] = NONE
        self._mark(s)
        # Its children keep their link: if the page is written again they hang on it again.
        if not st.kids[s]:
            st.release(s)

    # -- learning from the access stream --------------------------------------------------------

    def observe_write(
        self,
        ns: str,
        name: str,
        key_len: int,
        *,
        seq: int,
        at: float,
        guess: bool = True,
        written: Written | None = None,
        origin: str = "",
    ) -> str | None:
        """A file was stored (`written`: when, by the writer's clock, and its size; default:
        its last write at `at`) in `origin`'s stream (Stream); returns its page's predecessor
        (to persist): none if not `guess`."""
        key, stream = name[:key_len], (ns, name[key_len:], origin)
        seen, began, placed, size = written or Written(at)
        st = self.store
        with self.lock:
            prev = self._prev.get(stream)
            stored = self._stored.get(stream)
            self._prev[stream] = key
            self._stored[stream] = (seen, seen if placed is None else placed)
            pred = prev if guess and prev is not None and prev != key else None
            # After a read, or back to back: its last write began within BURST_GAP of the last
            # one's before it (mtime), or its file was made within BURST_GAP of that one's
            # rename (a page of megabytes takes longer than BURST_GAP to write). A file made
            # after its mtime had its times set (utime, a copy): its mtime alone says it.
            burst = (
                stored is None
                or seen - stored[0] <= BURST_GAP
                or (began is not None and began <= seen and began - stored[1] <= BURST_GAP)
            )
            s = st.ensure(ns, key)  # (one probe of the key table for the whole store)
            fresh = st.files[s] == GHOST
            self._page(s, seq, at, pred if burst else None, None, False)
            self._placed(s, stream[1], size, seq, at)
            self.clock = max(self.clock, seq)
            up = st.pred[s]  # (its chain's record: what the order values its segment by)
            chain = (st.reads[up], st.born[up]) if up != NONE else None
            self.adapt.stored(st.digest(s), seq, fresh, chain)
            if pred is not None and not burst and st.pred[s] == NONE and not st.conf[s]:
                # A vote, as a read's: a read right after `pred` links it (two agree).
                st.votes.put(s, hash(pred), st.suffix(stream[1]))
            return st.pred_key(s, pred)

    def observe_read(
        self, ns: str, name: str, key_len: int, *, seq: int, at: float, origin: str = ""
    ) -> tuple[bool, str | None]:
        """A file was read in `origin`'s stream (Stream); returns (whether this read changed its
        page's predecessor, the predecessor now if it did)."""
        key, stream = name[:key_len], (ns, name[key_len:], origin)
        st = self.store
        with self.lock:
            prev = self._prev.get(stream)
            self._prev[stream] = key
            self._stored.pop(stream, None)
            s = st.find(ns, key)
            if not st.present(s):
                return False, None
            st.put("reads", s, st.reads[s] + 1)
            st.used(s, seq, at)
            self.adapt.read(st.digest(s), seq)
            self._mark(s)
            self.clock = max(self.clock, seq)
            before = st.pred[s]
            if prev is None or prev == key:
                return False, None
            # The last contrary read is kept as (hash of its key, its stream's suffix number).
            sfx = st.suffix(stream[1])
            if before != NONE and st.same(before, prev):
                st.conf[s] = min(st.conf[s] + 1, CONFIDENCE_MAX)
            elif st.conf[s] > 0:
                st.conf[s] -= 1
            else:
                self._vote(s, prev, sfx)
            if st.pred[s] == before:
                return False, None
            return True, st.pred_key(s, prev)

    def _vote(self, s: int, prev: str, sfx: int) -> None:
        """A contrary read of page `s` right after `prev`, in the stream of suffix `sfx`, with no
        confidence left in its link: a second vote in a row for `prev` links it."""
        st, cand = self.store, hash(prev)
        vote = st.votes.get(s)
        if vote == (cand, sfx):  # two requests agree
            self._link(s, prev)
        elif vote is None or vote[0] != cand:  # (another rank's vote for the same: kept)
            st.votes.put(s, cand, sfx)
            self._link(s, None)

    def _mark(self, s: int) -> None:
        """Page `s` changed: the segment it is in (and its own, if a leaf) must be walked again."""
        if self.segments:  # (nothing to invalidate while nothing is known)
            self.dirty.add(s)
            if len(self.dirty) > DIRTY_MAX:
                self.segments.clear()
                self.dirty.clear()

    def _link(self, s: int, pred: str | None, trusted: bool = False) -> None:
        """Make `pred` the page's predecessor unless that closes a cycle. Only a page with a
        child on disk can be an ancestor: a new tail links without a walk up its chain."""
        st = self.store
        ns = st.ns_names[st.ns[s]]
        walk = pred is not None and not trusted and (st.kids[s] or st.same(s, pred))
        if walk and self._is_ancestor(s, st.find(ns, str(pred))):
            return
        if st.pred[s] != NONE:
            self._unkid(s, st.pred[s])
        st.pred[s], st.conf[s] = NONE, 0
        self._mark(s)
        if pred is None:
            return
        st.votes.drop(s)
        above = st.ensure(ns, pred)
        if above == s:  # (a damaged index's row naming its own page: no link, not a loop)
            return
        st.pred[s] = above
        if st.kids[above] == 1:
            self._mark(st.kidx[above])  # its only child's segment ends below it from now on
        st.put("kids", above, st.kids[above] + 1)
        st.kidx[above] ^= s
        self._mark(above)
        st.drop_leaf(above)

    def _is_ancestor(self, s: int, start: int) -> bool:
        """Whether slot `s` is `start` or one of its ancestors."""
        st, at = self.store, start
        for _ in range(CYCLE_WALK):
            if at == NONE:
                return False
            if at == s:
                return True
            at = st.pred[at] if st.files[at] != GHOST else NONE
        return True  # too deep to tell: refuse

    def _unkid(self, s: int, above: int) -> None:
        st = self.store
        st.kids[above] -= 1
        st.kidx[above] ^= s
        self._mark(above)  # (its segment, and its only child's if one is left, change)
        if st.kids[above]:
            return
        if st.files[above] != GHOST:
            st.add_leaf(above)
        else:
            st.release(above)

    # -- reading ----------------------------------------------------------------------------------

    def last_pages(self) -> list[tuple[Stream, str]]:
        """(stream, key) of the page each stream (Stream) accessed last."""
        with self.lock:
            return list(self._prev.items())

    def names(self, ns: str, key: str) -> tuple[str, ...]:
        """The file names of a page (none if it is not known)."""
        with self.lock:
            s = self.store.find(ns, key)
            return self.store.names(s) if self.store.present(s) else ()
