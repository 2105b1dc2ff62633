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

What the orders rank by is the stream's, so the miniatures share it: a page's first reference,
its last, and its returns since (the real model's reads, which the memory of evicted pages
gives back to a page written again: cachemgr.gc.history, as many as it remembers, scaled by
the rate). Each sampled page is a segment of its own (its chain's other pages are mostly not
in the sample): `value` evicts the lowest chain value first (cachemgr.gc.returns, its prior
fitted to the miniature's pages), `recency` the least recently used, `probation` the pages
unread since stored and past their trial first, then as `value`.

What a reference costs is the ranking (bench/bench_minisim.py): `recency` is kept in its order
(a hit moves a page to the end), so it never ranks; `value` and `probation` rank their pages
at each eviction, with the prior's sums kept as pages come and go (not summed again), and
`probation` values none when the pages past their trial are enough. Each evicts what it did
when it ranked everything afresh, so the orders' scores are unchanged.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable
from itertools import islice
from typing import Any

from cachemgr.gc.history import REMEMBER
from cachemgr.gc.returns import Moments, fitted, worth

MINI_PAGES = 8192  # pages a miniature holds at most (past it the sample halves)
MINI_MIN = MINI_PAGES // 16  # a smaller miniature is sampled again at a higher rate
LOW = 0.9  # a miniature over its capacity evicts down to this share of it
WINDOW = 8  # hits count for about WINDOW capacities' worth of sampled references (decay)
_BORN, _LAST, _READS, _HELD = range(4)
_RESCALE = 1e100  # a reference's weight past which the sums are scaled back
_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: the digest's bits spread over the top ones
_BITS = 64
_COLUMNS = 5  # a saved page: digest, born, last, reads, which miniatures hold it
Trial = Callable[[int, int], float]  # (clock, pages on disk) -> the trial's start (an access)


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
        self.pages: dict[int, list[int]] = {}  # digest -> [born, last, reads, held: a bit each]
        self.ghosts: OrderedDict[int, None] = OrderedDict()  # pages none holds, oldest first
        # The pages each holds by digest, oldest first (what breaks ties in its order).
        self.held = self._empty()
        # Each ranked miniature's sums over its pages of reads c and birth b (c, b, cc, cb, bb):
        # the prior its order fits (cachemgr.gc.returns.Moments), kept as pages come and go.
        self.sums = [[0] * 5 for _ in range(self.orders)]
        # Hits and references decayed by `decay` a reference, kept as sums of weights that
        # grow by 1/decay a reference instead (the window's scores are the sums / `_weight`):
        # a reference adds to one or two sums, not scales them all.
        self._hits = array("d", [0.0] * self.orders)
        self._refs = 0.0
        self._weight = 1.0  # the latest reference's
        self._grow = 1.0 / (1.0 - 1.0 / (WINDOW * MINI_PAGES))

    def reference(
        self, digest: int, clock: int, read: bool, chain: tuple[int, int] | None = None
    ) -> None:
        """A page with this key digest was read or stored (not on disk before) at `clock`;
        `chain`: the (reads, birth) of the page it continues, which a page new to the sample
        takes as its own, as the real order values a segment by its top page."""
        if self.shift and _mixed(digest) >> (_BITS - self.shift):
            return
        if self._weight > _RESCALE:
            self._rescale()
        hits, weight = self._hits, self._weight * self._grow
        self._weight = weight
        self._refs += weight
        page = self.pages.get(digest)
        if page is None:
            reads, born = chain if chain is not None else (int(read), clock)
            page = self.pages[digest] = [min(born, clock), clock, reads, 0]
        else:
            if not page[_HELD]:
                del self.ghosts[digest]
            page[_READS] += 1
            page[_LAST] = clock
        was = page[_HELD]  # (an eviction below changes only its own miniature's bit)
        lru = self.lru
        for o, held in enumerate(self.held):
            if was >> o & 1:
                hits[o] += weight
                if o == lru:
                    held.move_to_end(digest)  # type: ignore[attr-defined]
                else:  # (its reads went from c - 1 to c)
                    sums, c = self.sums[o], page[_READS]
                    sums[0] += 1
                    sums[2] += 2 * c - 1
                    sums[3] += page[_BORN]
            else:
                page[_HELD] |= 1 << o
                held[digest] = page
                if o != lru:
                    self._tally(o, page, 1)
        # (Each evicts once all hold the page: one may evict it at once, valued least, while
        # another keeps it; it is a ghost, to be forgotten, only if none holds it.)
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
        ranked = o != self.lru
        for digest in self._lowest(o, go, clock) if ranked else list(islice(held, go)):
            page = self.pages[digest]
            page[_HELD] &= ~bit
            del held[digest]
            if ranked:
                self._tally(o, page, -1)
            if not page[_HELD]:
                self.ghosts[digest] = None
        while len(self.ghosts) > REMEMBER >> self.shift:
            del self.pages[self.ghosts.popitem(last=False)[0]]

    def _tally(self, o: int, page: list[int], sign: int) -> None:
        """Page `page` came into ranked miniature `o` (sign 1) or left it (-1): its sums."""
        sums, c, b = self.sums[o], page[_READS], page[_BORN]
        sums[0] += sign * c
        sums[1] += sign * b
        sums[2] += sign * c * c
        sums[3] += sign * c * b
        sums[4] += sign * b * b

    def _retally(self) -> None:
        self.sums = [[0] * 5 for _ in range(self.orders)]
        for o, held in enumerate(self.held):
            for digest in held if o != self.lru else ():
                self._tally(o, self.pages[digest], 1)

    def _prior(self, o: int, clock: int) -> tuple[float, float]:
        """The prior order `o` fits to its miniature's pages now: their exposures are
        clock - b (no page was born after the clock)."""
        c, b, cc, cb, bb = self.sums[o]
        n = len(self.held[o])
        return fitted(
            Moments(c, n * clock - b, cc, clock * c - cb, clock * clock * n - 2 * clock * b + bb)
        )

    def _lowest(self, o: int, n: int, clock: int) -> list[int]:
        """The `n` digests miniature `o` evicts first (ties: the least recently used, then
        the one it took first)."""
        digests = list(self.held[o])
        pages = list(self.held[o].values())
        trial_end = -math.inf  # (`value`: no page is past a trial)
        if self.names[o] == "probation":
            trial_end = self.trial(clock, self.cap << self.shift)
            past = [i for i, p in enumerate(pages) if p[_LAST] < trial_end and not p[_READS]]
            if len(past) >= n:  # (they go first, oldest first: no page needs valuing)
                past.sort(key=lambda i: pages[i][_LAST])
                return [digests[i] for i in past[:n]]
        keys = self._keys(pages, clock, trial_end, self._prior(o, clock))
        least = sorted(keys)[n - 1]  # (only the pages at most this low need ranking)
        ranked = sorted((k, pages[i][_LAST], i) for i, k in enumerate(keys) if k <= least)
        return [digests[i] for _, _, i in ranked[:n]]

    @staticmethod
    def _keys(
        pages: list[list[int]], clock: int, trial_end: float, fit: tuple[float, float]
    ) -> list[float]:
        """The pages' keys, lowest first to go: the chain value (with the prior `fit`), but
        first a page unread since stored before `trial_end` (`probation`)."""
        return [
            -0.5
            if p[_LAST] < trial_end and not p[_READS]
            else worth(fit, p[_READS], max(p[_LAST] - p[_BORN], 0), clock - p[_LAST])
            for p in pages
        ]

    def _resample(self, shift: int) -> None:
        """Sample at 2^-shift: the pages out of the smaller sample are forgotten."""
        self.shift = shift
        for digest in [d for d in self.pages if _mixed(d) >> (_BITS - shift)]:
            page = self.pages.pop(digest)
            if not page[_HELD]:
                del self.ghosts[digest]
            for held in self.held:
                held.pop(digest, None)
        self._retally()

    def _restart(self, shift: int) -> None:
        """Sample at a higher rate: the pages it adds are unknown, so start empty."""
        self.shift = shift
        self.pages.clear()
        self.ghosts.clear()
        self.held = self._empty()
        self.sums = [[0] * 5 for _ in range(self.orders)]
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
        self._retally()
        self._capacity(int(state["cap"]))
