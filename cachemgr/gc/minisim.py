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
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from cachemgr.gc.history import REMEMBER
from cachemgr.gc.returns import prior, worth

MINI_PAGES = 8192  # pages a miniature holds at most (past it the sample halves)
MINI_MIN = MINI_PAGES // 16  # a smaller miniature is sampled again at a higher rate
LOW = 0.9  # a miniature over its capacity evicts down to this share of it
WINDOW = 8  # hits count for about WINDOW capacities' worth of sampled references (decay)
_BORN, _LAST, _READS, _HELD = range(4)
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
        self.pages: dict[int, list[int]] = {}  # digest -> [born, last, reads, held: a bit each]
        self.ghosts: OrderedDict[int, None] = OrderedDict()  # pages none holds, oldest first
        # The digests each holds, oldest first (what breaks ties in its order).
        self.held: list[dict[int, None]] = [{} for _ in range(self.orders)]
        self.hits = array("d", [0.0] * self.orders)  # decayed, as `refs`
        self.refs = 0.0
        self._decay = 1.0 - 1.0 / (WINDOW * MINI_PAGES)

    def reference(
        self, digest: int, clock: int, read: bool, chain: tuple[int, int] | None = None
    ) -> None:
        """A page with this key digest was read or stored (not on disk before) at `clock`;
        `chain`: the (reads, birth) of the page it continues, which a page new to the sample
        takes as its own, as the real order values a segment by its top page."""
        if self.shift and _mixed(digest) >> (_BITS - self.shift):
            return
        hits, decay = self.hits, self._decay
        self.refs = self.refs * decay + 1.0
        page = self.pages.get(digest)
        if page is None:
            reads, born = chain if chain is not None else (int(read), clock)
            page = self.pages[digest] = [born, clock, reads, 0]
        else:
            if not page[_HELD]:
                del self.ghosts[digest]
            page[_READS] += 1
            page[_LAST] = clock
        for o in range(self.orders):
            hits[o] *= decay
            if page[_HELD] >> o & 1:
                hits[o] += 1.0
            else:
                page[_HELD] |= 1 << o
                self.held[o][digest] = None
                if self.cap and len(self.held[o]) > self.cap:
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
        self.cap = max(pages >> self.shift, 1)
        self._decay = 1.0 - 1.0 / (WINDOW * self.cap)
        for o in range(self.orders):
            if len(self.held[o]) > self.cap:
                self._evict(o, clock)

    def ratios(self) -> list[float]:
        """Each miniature's hit ratio over the recent window (decayed)."""
        return [h / self.refs if self.refs else 0.0 for h in self.hits]

    def _evict(self, o: int, clock: int) -> None:
        """Miniature `o` is over its capacity: evict in its order down to LOW of it."""
        bit = 1 << o
        held = self.held[o]
        mine = [(d, self.pages[d]) for d in held]
        keys = self._keys(o, [p for _, p in mine], clock)
        ranked = sorted(range(len(mine)), key=lambda i: (keys[i], mine[i][1][_LAST]))
        for i in ranked[: len(held) - int(LOW * self.cap)]:
            digest, page = mine[i]
            page[_HELD] &= ~bit
            del held[digest]
            if not page[_HELD]:
                self.ghosts[digest] = None
        while len(self.ghosts) > REMEMBER >> self.shift:
            del self.pages[self.ghosts.popitem(last=False)[0]]

    def _keys(self, o: int, pages: list[list[int]], clock: int) -> list[float]:
        """The pages' keys in order `o`, lowest first to go."""
        if self.names[o] == "recency":
            return [float(p[_LAST]) for p in pages]
        fitted = prior([(p[_READS], max(clock - p[_BORN], 0)) for p in pages])
        values = [
            worth(fitted, p[_READS], max(p[_LAST] - p[_BORN], 0), clock - p[_LAST]) for p in pages
        ]
        if self.names[o] != "probation":
            return values
        trial_end = self.trial(clock, self.cap << self.shift)
        return [
            -0.5 if not p[_READS] and p[_LAST] < trial_end else v
            for p, v in zip(pages, values, strict=True)
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

    def _restart(self, shift: int) -> None:
        """Sample at a higher rate: the pages it adds are unknown, so start empty."""
        self.shift = shift
        self.pages.clear()
        self.ghosts.clear()
        self.held = [{} for _ in range(self.orders)]
        self._score_from_now()

    def _score_from_now(self) -> None:
        self.refs = 0.0
        self.hits = array("d", [0.0] * self.orders)

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
        self.hits = array("d", [float(h) for h in state["hits"]])
        self.refs = float(state["refs"])
        for i in range(0, len(table), _COLUMNS):
            digest, *page = table[i : i + _COLUMNS]
            self.pages[digest] = page
            if not page[_HELD]:
                self.ghosts[digest] = None
            for o in range(self.orders):
                if page[_HELD] >> o & 1:
                    self.held[o][digest] = None
        self.cap = int(state["cap"])
        self._decay = 1.0 - 1.0 / (WINDOW * (self.cap or MINI_PAGES))
