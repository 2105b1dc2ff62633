"""Miniature caches, one per eviction order, on a spatial sample of the keys (Waldspurger et
al., USENIX ATC'17, "Cache Modeling and Optimization using Miniature Simulations"): how each
order would do if it were followed, judged on what it would have kept itself, not on what the
order followed left (cachemgr.gc.adapt chooses by them).

A page is in the sample, always or never, when the top `shift` bits of a mix of its key's
digest are zero: a rate of 2^-shift, the largest at which a miniature holds at most
MINI_PAGES pages. Every miniature sees the whole sampled stream: each read of a sampled page,
and each store of one that was not on disk (a first store, or one after the real cache
evicted it; a second file of a page is not a reference). A reference is a hit for each
miniature that holds the page, and a miss that inserts it in the others; a miniature over its
capacity (the pages on disk at the real cache's last plan, times the rate) evicts down to LOW
of it in its own order, as GC does.

What the orders rank by is the stream's, so the miniatures share it. The real order ranks
*segments* (cachemgr.gc.value: a chain's pages up to below a branch point, valued together by
their top page's record, each leaf to top), and so do the miniatures: with each reference the
real model says the page's segment (its top page's key digest) and that top's record (its
returns and birth: the real model's, which the memory of evicted pages gives back to a page
written again: cachemgr.gc.history). A miniature groups the pages it holds by segment (few of
a segment's pages are in a sparse sample, but each goes when its segment would): `value`
evicts the lowest chain value first (cachemgr.gc.returns, its prior fitted to the
miniature's segments, their latest use the latest of their pages'), `probation` first the
segments unread since stored and past their trial, then as `value`; within a segment the
pages referenced last (its tail) go first. Valued page by page instead, `value`'s miniature
evicted a conversation's head before its tail and scored what the order does on pages with no
links (conversation trace, W/10: 0.262, where the order itself hits 0.283; bench/RESULTS.md).
`recency` evicts the least recently used page.

What a reference costs is the ranking (bench/bench_minisim.py): `recency` is kept in its order
(a hit moves a page to the end), so it never ranks; `value` and `probation` group and rank
their pages at each eviction, and `probation` values none when the segments past their trial
are enough.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable
from itertools import islice
from typing import Any

from cachemgr.gc import _rank
from cachemgr.gc.history import REMEMBER
from cachemgr.gc.returns import fitted, moments

MINI_PAGES = 8192  # pages a miniature holds at most (past it the sample halves)
MINI_MIN = MINI_PAGES // 16  # a smaller miniature is sampled again at a higher rate
LOW = 0.9  # a miniature over its capacity evicts down to this share of it
WINDOW = 8  # hits count for about WINDOW capacities' worth of sampled references (decay)
# A sampled page: its first reference, its last, which miniatures hold it (a bit each), its
# segment's top (a key digest), that top's returns and birth, and whether the page heads two
# chains or more (1: a branch point), as of its last reference.
_FIRST, _LAST, _HELD, _TOP, _READS, _BORN, _INNER = range(7)
_RESCALE = 1e100  # a reference's weight past which the sums are scaled back
_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: the digest's bits spread over the top ones
_BITS = 64
_COLUMNS = 8  # a saved page: its digest and its _FIRST.._INNER
_PAGES = 4  # where a segment's digests start in the list `_segments` groups it in
_VALUE, _PROBATION = 0, 2  # cachemgr.gc._rank.rank's modes
Trial = Callable[[int, int], float]  # (clock, pages on disk) -> the trial's start (an access)
# A page's segment: its top's key digest, returns and birth; 1 if the page is a branch point.
Segment = tuple[int, int, int, int]


def _latest_use(segment: list[int]) -> int:
    return segment[0]


def _mixed(digest: int) -> int:
    return (digest * _MIX) & ((1 << _BITS) - 1)


class Miniatures:
    """The sample's pages and each miniature's hits; the chain model's lock guards it."""

    def __init__(self, orders: tuple[str, ...], trial: Trial) -> None:
        self.names = orders  # cachemgr.gc.adapt.ORDERS
        self.orders = len(orders)
        self.trial = trial  # when a page unread since stored leaves probation (cachemgr.gc.adapt)
        self.shift = 0
        self.cap = 0  # pages a miniature holds (0: the real cache was never planned: no limit)
        self.limit = sys.maxsize  # pages past which a miniature evicts (`cap`, or none)
        # The miniature kept in least recently used order (a hit moves a page to its end).
        self.lru = orders.index("recency") if "recency" in orders else -1
        self.pages: dict[int, list[int]] = {}  # digest -> [_FIRST, ..., _BORN]
        self.ghosts: OrderedDict[int, None] = OrderedDict()  # pages none holds, oldest first
        # The pages each holds by digest, oldest first (what breaks ties in its order).
        self.held = self._empty()
        # Hits and references decayed by `decay` a reference, kept as sums of weights that
        # grow by 1/decay a reference instead (the window's scores are the sums / `_weight`):
        # a reference adds to one or two sums, not scales them all.
        self._hits = array("d", [0.0] * self.orders)
        self._refs = 0.0
        self._weight = 1.0  # the latest reference's
        self._grow = 1.0 / (1.0 - 1.0 / (WINDOW * MINI_PAGES))

    def reference(
        self, digest: int, clock: int, read: bool, segment: Segment | None = None
    ) -> None:
        """A page with this key digest was read or stored (not on disk before) at `clock`;
        `segment`: its segment now (None: a segment of its own, its returns counted here)."""
        if self.shift and _mixed(digest) >> (_BITS - self.shift):
            return
        if self._weight > _RESCALE:
            self._rescale()
        hits, weight = self._hits, self._weight * self._grow
        self._weight = weight
        self._refs += weight
        page = self.pages.get(digest)
        if page is None:
            page = self.pages[digest] = [clock, clock, 0, digest, int(read), clock, 0]
        else:
            if not page[_HELD]:
                del self.ghosts[digest]
            page[_READS] += 1
            page[_LAST] = clock
        if segment is not None:
            page[_TOP], page[_READS], page[_BORN], page[_INNER] = segment
        was, lru = page[_HELD], self.lru
        for o, held in enumerate(self.held):
            if was >> o & 1:
                hits[o] += weight
                if o == lru:
                    held.move_to_end(digest)  # type: ignore[attr-defined]
            else:
                page[_HELD] |= 1 << o
                held[digest] = page
        # (Each evicts once all hold the page: one may evict it at once, a tail of a segment
        # it values least, and it is a ghost only if none holds it.)
        for o, held in enumerate(self.held):
            if len(held) > self.limit:
                self._evict(o, clock)
        if not self.cap and len(self.pages) > 2 * MINI_PAGES:
            self._resample(self.shift + 1)  # (a big cache not planned yet: sample less of it)

    def size(self, pages: int, clock: int) -> None:
        """The real cache holds this many pages when it plans: scale the miniatures to it."""
        shift = 0  # (the rate this many pages call for)
        while pages >> shift > MINI_PAGES:
            shift += 1
        if not self.cap:
            self._score_from_now()  # (no miniature evicted yet: all have the same hits)
        if shift > self.shift:
            self._resample(shift)
        elif shift < self.shift and pages >> self.shift < MINI_MIN:
            self._restart(shift)  # (the cap came down a lot: too few pages left to tell)
        self._capacity(max(pages >> self.shift, 1))
        for o in range(self.orders):
            if len(self.held[o]) > self.limit:
                self._evict(o, clock)

    def _capacity(self, cap: int) -> None:
        self.cap = cap
        self.limit = cap or sys.maxsize
        self._rescale()  # (the weights so far grew at the old rate)
        self._grow = 1.0 / (1.0 - 1.0 / (WINDOW * (cap or MINI_PAGES)))

    def _rescale(self) -> None:
        w, hits = self._weight, self._hits
        for o in range(self.orders):
            hits[o] /= w
        self._refs /= w
        self._weight = 1.0

    @property
    def hits(self) -> list[float]:
        """Each miniature's hits over the recent window (decayed, as `refs`)."""
        return [h / self._weight for h in self._hits]

    @property
    def refs(self) -> float:
        """The sampled references over the recent window (decayed)."""
        return self._refs / self._weight

    def ratios(self) -> list[float]:
        """Each miniature's hit ratio over the recent window (decayed)."""
        return [h / self._refs if self._refs else 0.0 for h in self._hits]

    def _evict(self, o: int, clock: int) -> None:
        """Miniature `o` is over its capacity: evict in its order down to LOW of it."""
        bit = 1 << o
        held = self.held[o]
        go = len(held) - int(LOW * self.cap)
        for digest in self._lowest(o, go, clock) if o != self.lru else list(islice(held, go)):
            page = self.pages[digest]
            page[_HELD] &= ~bit
            del held[digest]
            if not page[_HELD]:
                self.ghosts[digest] = None
        while len(self.ghosts) > REMEMBER >> self.shift:
            del self.pages[self.ghosts.popitem(last=False)[0]]

    def _lowest(self, o: int, n: int, clock: int) -> list[int]:
        """The `n` digests miniature `o` evicts first: its segments lowest first, valued as
        the real order values its one-page segments (cachemgr.gc._rank; ties: the least
        recently used, then the one it took first), each tail first; those with a branch
        point last (the real order ranks one once the chains below it are gone)."""
        segs, inner = self._segments(o)
        if self.names[o] == "probation":
            trial_end, mode = self.trial(clock, self.cap << self.shift), _PROBATION
            past = [g for g in segs if g[0] < trial_end and not g[1]]
            if sum(len(g) - _PAGES for g in past) >= n:  # (they go first: none is valued)
                return self._tails(sorted(past, key=_latest_use), n)
        else:
            trial_end, mode = -math.inf, _VALUE
        last = array("q", [g[0] for g in segs])
        reads, born = array("q", [g[1] for g in segs]), array("q", [g[2] for g in segs])
        exposures = [max(clock - b, 0) for b in born]
        shape, rate = fitted(moments(zip(reads, exposures, strict=True)))
        at = array("i", range(len(segs)))
        _, ranked = _rank.rank(
            at, at, reads, born, last, array("d", last), clock, trial_end, mode, shape, rate
        )
        order = [segs[i] for i in memoryview(ranked).cast("i")]
        return self._tails(order + sorted(inner, key=_latest_use), n)

    def _segments(self, o: int) -> tuple[list[list[int]], list[list[int]]]:
        """Miniature `o`'s pages by segment, as [latest use, returns, birth, a branch point
        in it (0/1), digests...] (the record the latest reference brought): those without a
        branch point, and those with one."""
        segments: dict[int, list[int]] = {}
        for digest, page in self.held[o].items():
            seg = segments.get(page[_TOP])
            if seg is None:
                top = page[_TOP]
                segments[top] = [page[_LAST], page[_READS], page[_BORN], page[_INNER], digest]
                continue
            if page[_LAST] > seg[0]:
                seg[0], seg[1], seg[2] = page[_LAST], page[_READS], page[_BORN]
            seg[3] |= page[_INNER]
            seg.append(digest)
        groups = segments.values()
        return [g for g in groups if not g[3]], [g for g in groups if g[3]]

    def _tails(self, segments: list[list[int]], n: int) -> list[int]:
        """The first `n` pages of these segments in this order, each segment tail first (the
        page it took last first)."""
        out: list[int] = []
        pages = self.pages
        for g in segments:
            out += sorted(g[_PAGES:], key=lambda d: pages[d][_FIRST], reverse=True)
            if len(out) >= n:
                break
        return out[:n]

    def _resample(self, shift: int) -> None:
        """Sample at 2^-shift: the pages out of the smaller sample are forgotten."""
        self.shift = shift
        for digest in [d for d in self.pages if _mixed(d) >> (_BITS - shift)]:
            page = self.pages.pop(digest)
            if not page[_HELD]:
                del self.ghosts[digest]
            for held in self.held:
                held.pop(digest, None)

    def _restart(self, shift: int) -> None:
        """Sample at a higher rate: the pages it adds are unknown, so start empty."""
        self.shift = shift
        self.pages.clear()
        self.ghosts.clear()
        self.held = self._empty()
        self._score_from_now()

    def _empty(self) -> list[dict[int, list[int]]]:
        return [OrderedDict() if o == self.lru else {} for o in range(self.orders)]

    def _score_from_now(self) -> None:
        self._refs, self._weight = 0.0, 1.0
        self._hits = array("d", [0.0] * self.orders)

    def state(self) -> dict[str, Any]:
        """What the model file keeps besides the pages (`table`)."""
        return {"shift": self.shift, "cap": self.cap, "hits": list(self.hits), "refs": self.refs}

    def table(self) -> array[int]:
        """The sampled pages as rows of _COLUMNS, those held first, then the ghosts oldest
        first (their order is what forgets them)."""
        out = array("q")
        held = [d for d, p in self.pages.items() if p[_HELD]]
        for d in [*held, *self.ghosts]:
            out.extend((d, *self.pages[d]))
        return out

    def restore(self, state: dict[str, Any], table: array[int]) -> None:
        """Take a saved state and table back."""
        self._restart(int(state["shift"]))
        self._hits = array("d", [float(h) for h in state["hits"]])
        self._refs = float(state["refs"])
        for i in range(0, len(table), _COLUMNS):
            digest, *page = table[i : i + _COLUMNS]
            self.pages[digest] = page
            if not page[_HELD]:
                self.ghosts[digest] = None
            for o in range(self.orders):
                if page[_HELD] >> o & 1:
                    self.held[o][digest] = page
        if self.lru >= 0:  # (the table keeps no use order: the pages' latest use is it)
            lru = sorted(self.held[self.lru], key=lambda d: self.pages[d][_LAST])
            self.held[self.lru] = OrderedDict((d, self.pages[d]) for d in lru)
        self._capacity(int(state["cap"]))
