"""Prefix chains learned from the order of page accesses, and what is known of each page's use.

SGLang loads the longest *contiguous* prefix of a request's pages: a page is useful only while
every earlier page of its chain is on disk. The file names do not say which page comes before
which, but the access stream does. One I/O thread per rank reads a request's hits head → tail
(`batch_get`) and the backup thread writes its new pages in order right after, so:

* a page **written** right after page P of the same stream (namespace and file suffix: one
  rank's files) most likely continues P: that is its first guess of a predecessor;
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
a CLI run builds one from the index (`load`), where the learned links are stored.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from cachemgr.backends import FileFormat
from cachemgr.sglang.hicache import HICACHE_FILE
from cachemgr.state import pages_sql

PageId = tuple[str, str]  # (namespace id, page key)
CONFIDENCE_MAX = 3  # agreeing reads a link may bank against later contrary evidence
CYCLE_WALK = 100_000  # ancestors walked at most to refuse a cycle (chains are far shorter)
# Accesses (of any page) since a page's last use during which the live daemon deems it in
# flight: its request may still be writing the pages that continue it (or another rank's file
# of it); deleting it then would strand those behind a gap. Counted in accesses (any rate),
# and only for IN_FLIGHT_SECONDS: when the writer stops, nothing stays in flight.
IN_FLIGHT = 1024
IN_FLIGHT_SECONDS = 2.0


@dataclass(slots=True)
class Page:
    """One logical page (all its files): its learned predecessor and its use, in access seqs."""

    pred: str | None  # key of the page before it in its chain (same namespace)
    born: int  # access sequence of its first write (or of when the index first saw it)
    last: int  # access sequence of its latest read or write
    last_time: float  # wall-clock time of that access (only for min_age)
    reads: int = 0
    conf: int = 0  # agreeing reads banked for `pred`
    # (predecessor, file suffix) the last contrary read named, and in which stream (one rank's
    # files: every rank reads a request's pages, so two ranks agreeing is one request's word)
    cand: tuple[str, str] | None = None
    # (name after the key, size) of each file; the suffixes are interned: a million pages of
    # one namespace share a handful of them.
    files: tuple[tuple[str, int], ...] = ()

    @property
    def size(self) -> int:
        return sum(size for _, size in self.files)

    def names(self, key: str) -> tuple[str, ...]:
        return tuple(sorted(key + suffix for suffix, _ in self.files))


class ChainModel:
    """Every indexed page, its learned chain link, and how many children it has on disk.

    Thread-safe: the index thread observes, the GC thread reads an order (`lock`).
    """

    def __init__(self, fmt: FileFormat = HICACHE_FILE, *, in_flight: int = 0) -> None:
        self.fmt = fmt  # what the names in a namespace dir mean
        self.in_flight = in_flight  # the last accesses whose pages GC leaves alone
        self.pages: dict[PageId, Page] = {}
        self.kids: dict[PageId, int] = {}  # pred id -> its children on disk (> 0)
        self.leaves: set[PageId] = set()  # pages on disk with no child on disk
        self.clock = 0  # the largest access sequence seen
        self._prev: dict[tuple[str, str], str] = {}  # (ns, file suffix) -> last page key
        self.lock = threading.RLock()

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
        reads: int = 0,
        trusted: bool = False,
    ) -> None:
        """Index one file (a page's first file creates the page; a known page keeps its use).
        `trusted`: `pred` comes from the index, where no link closes a cycle."""
        key, suffix = name[:key_len], sys.intern(name[key_len:])
        pid = (ns, key)
        with self.lock:
            page = self.pages.get(pid)
            if page is None:
                page = self.pages[pid] = Page(None, seq if born is None else born, seq, at)
                if pid not in self.kids:
                    self.leaves.add(pid)
                self._link(pid, page, pred, trusted)
            elif page.pred is None and pred is not None:
                self._link(pid, page, pred, trusted)
            page.files = (*(f for f in page.files if f[0] != suffix), (suffix, size))
            page.reads = max(page.reads, reads)
            if seq > page.last:
                page.last, page.last_time = seq, at
            self.clock = max(self.clock, seq)

    @classmethod
    def from_index(cls, conn: sqlite3.Connection, ns_ids: Iterable[str]) -> ChainModel:
        """A model of these namespaces as the index holds them."""
        model = cls()
        for ns in ns_ids:
            model.load(conn, ns)
        return model

    def load(self, conn: sqlite3.Connection, ns: str) -> None:
        """(Re)build a namespace's pages from the index: after a scan changed it, at start-up,
        or for a one-off GC run. The order of accesses within it is not stored: only links."""
        with self.lock:
            self.forget(ns)
            for name, key_len, size, at, seq, reads, pred, born in pages_sql.chain_rows(conn, ns):
                self.add(ns, name, key_len, size, seq=seq, at=at, pred=pred, born=born,
                         reads=reads, trusted=True)  # fmt: skip

    def remove(self, ns: str, names: Iterable[tuple[str, int]]) -> None:
        """Forget files (name, key_len) that are gone; a page goes with its last file."""
        with self.lock:
            for name, key_len in names:
                pid = (ns, name[:key_len])
                page = self.pages.get(pid)
                if page is None:
                    continue
                page.files = tuple(f for f in page.files if f[0] != name[key_len:])
                if not page.files:
                    self._drop(pid, page)

    def forget_gone(self, ns: str, ns_dir: str, names: Iterable[str]) -> None:
        """Forget those of these files of `ns` (in `ns_dir`) that are gone: after GC deleted
        them, before the watcher's events say so (a run right after must not pick them)."""
        gone = [n for n in names if not os.path.lexists(os.path.join(ns_dir, n))]
        self.remove(ns, [(n, self.fmt.key_len(n) or len(n)) for n in gone])

    def forget(self, ns: str) -> None:
        """Forget a whole namespace (its dir is gone)."""
        with self.lock:
            for pid in [p for p in self.pages if p[0] == ns]:
                self._drop(pid, self.pages[pid])
            self._prev = {s: k for s, k in self._prev.items() if s[0] != ns}

    def _drop(self, pid: PageId, page: Page) -> None:
        del self.pages[pid]
        self.leaves.discard(pid)
        if page.pred is not None:
            self._unkid(pid, page.pred)
        # Its children keep their link: if the page is written again they hang on it again.

    # -- learning from the access stream --------------------------------------------------------

    def observe_write(self, ns: str, name: str, key_len: int, *, seq: int, at: float) -> str | None:
        """A file was stored; returns its page's predecessor (the first guess, to persist)."""
        key, stream = name[:key_len], (ns, name[key_len:])
        with self.lock:
            prev = self._prev.get(stream)
            self._prev[stream] = key
            guess = prev if prev is not None and prev != key else None
            self.add(ns, name, key_len, 0, seq=seq, at=at, pred=guess)  # moves `last` on too
            return self.pages[(ns, key)].pred

    def observe_read(
        self, ns: str, name: str, key_len: int, *, seq: int, at: float
    ) -> tuple[bool, str | None]:
        """A file was read; returns (whether this read changed its page's predecessor, the
        predecessor now)."""
        key, stream = name[:key_len], (ns, name[key_len:])
        with self.lock:
            prev = self._prev.get(stream)
            self._prev[stream] = key
            page = self.pages.get((ns, key))
            if page is None:
                return False, None
            page.reads += 1
            page.last, page.last_time = seq, at
            self.clock = max(self.clock, seq)
            before = page.pred
            if prev is None or prev == key:
                return False, before
            if page.pred == prev:
                page.conf = min(page.conf + 1, CONFIDENCE_MAX)
            elif page.conf > 0:
                page.conf -= 1
            elif page.cand == (prev, stream[1]):  # two requests in a row name the same page
                self._link((ns, key), page, prev)
            elif page.cand is None or page.cand[0] != prev:  # (another rank: the same word)
                page.cand = (prev, stream[1])
                self._link((ns, key), page, None)
            return page.pred != before, page.pred

    def _link(self, pid: PageId, page: Page, pred: str | None, trusted: bool = False) -> None:
        """Make `pred` the page's predecessor unless that closes a cycle. Only a page with a
        child on disk can be an ancestor: a new tail links without a walk up its chain."""
        ns = pid[0]
        walk = pid in self.kids or pred == pid[1]
        if pred is not None and not trusted and walk and self._is_ancestor(ns, pid[1], pred):
            return
        if page.pred is not None:
            self._unkid(pid, page.pred)
        page.pred, page.conf, page.cand = pred, 0, page.cand if pred is None else None
        if pred is not None:
            above = (ns, pred)
            self.kids[above] = self.kids.get(above, 0) + 1
            self.leaves.discard(above)

    def _is_ancestor(self, ns: str, key: str, start: str) -> bool:
        """Whether `key` is `start` or one of its ancestors."""
        at: str | None = start
        for _ in range(CYCLE_WALK):
            if at is None:
                return False
            if at == key:
                return True
            page = self.pages.get((ns, at))
            at = page.pred if page is not None else None
        return True  # too deep to tell: refuse

    def _unkid(self, pid: PageId, pred: str) -> None:
        above = (pid[0], pred)
        left = self.kids.get(above, 0) - 1
        if left > 0:
            self.kids[above] = left
            return
        self.kids.pop(above, None)
        if above in self.pages:
            self.leaves.add(above)

    # -- reading ----------------------------------------------------------------------------------

    def lineage(self, pid: PageId) -> set[PageId]:
        """The page and its known ancestors (on disk or not)."""
        ns, out = pid[0], {pid}
        with self.lock:
            page = self.pages.get(pid)
            while page is not None and page.pred is not None and len(out) < CYCLE_WALK:
                out.add((ns, page.pred))
                page = self.pages.get((ns, page.pred))
        return out

    def names(self, ns: str, key: str) -> tuple[str, ...]:
        """The file names of a page (none if it is not known)."""
        with self.lock:
            page = self.pages.get((ns, key))
            return page.names(key) if page is not None else ()
