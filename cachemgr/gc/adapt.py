"""Which eviction order to follow: the one whose miniature cache has the best hit ratio lately
(cachemgr.gc.minisim: each order run as a tiny cache on a spatial sample of the keys).

Three orders rank the same segments, tails first in each (cachemgr.gc.value):

* `value`: the chain value (returns, age and silence of the chain, Gamma-Poisson);
* `recency`: chain-tail-first LRU (the segment's latest use);
* `probation`: S3-FIFO's small queue on chains: a segment nothing read since it was stored is
  on trial while PROBATION of the pages on disk are stored after it (by the recent store
  rate, `span`); past that it goes first (oldest first); the rest in the `value` order.

Each miniature sees every sampled reference whatever the real cache holds, so each order is
scored on what it would have kept itself: no order is favoured by being followed or not (the
bias of scoring the others by what they would have evicted from the followed order's cache,
bench/RESULTS.md). At every GC plan the miniatures are scaled to the pages on disk, and the
order followed becomes the one whose decayed hits are MARGIN more than the current one's. A
plan changes nothing the next one reads, so a dry run plans what the real run after it does.
"""

from __future__ import annotations

import logging
import math
from array import array
from collections.abc import Sequence
from typing import Any

from cachemgr.gc.minisim import Miniatures

log = logging.getLogger(__name__)

ORDERS = ("value", "recency", "probation")
PROBATION = 0.25  # a page unread since stored is on trial while this share of the disk is stored
MARGIN = 0.005  # share by which another miniature's hits must be more to switch to its order
KIND = "miniatures"  # the saved state's kind (another: a build before them, ignored)


def switched(hits: Sequence[float], follow: int) -> int:
    """The order to follow, given each order's recent hits and the one followed: the best, if
    its hits are MARGIN more than the followed one's (bench/sim_policy.py's perfect
    miniatures choose by it too)."""
    best = max(range(len(hits)), key=lambda o: (hits[o], o == follow))
    return best if hits[best] > (1.0 + MARGIN) * hits[follow] else follow


class Adaptive:
    """The order followed, the store rate and the miniatures; the chain model's lock guards it."""

    def __init__(self) -> None:
        self.follow = 0  # index of the order followed
        # An order followed whatever the miniatures say (bench/sim_policy.py's `--orders`).
        self.fixed: int | None = None
        self.stores, self.stores_since = 0, -1  # stores seen, since which access
        self.mini = Miniatures(ORDERS, self.trial_end)

    def stored(
        self, digest: int, clock: int, fresh: bool, chain: tuple[int, int] | None = None
    ) -> None:
        """A file of the page with this key digest was stored at access `clock`; `fresh`: the
        page was not on disk before (else another file of it); `chain`: the (reads, birth) of
        the page it continues, if known."""
        if self.stores_since < 0:
            self.stores_since = clock
        self.stores += 1
        if fresh:
            self.mini.reference(digest, clock, read=False, chain=chain)

    def read(self, digest: int, clock: int) -> None:
        """A file of the page with this key digest was read at access `clock`."""
        self.mini.reference(digest, clock, read=True)

    def span(self, pages: float, clock: int) -> float:
        """Accesses in which about this many pages are stored (inf before any store)."""
        if not self.stores:
            return math.inf
        return pages * max(clock - self.stores_since, 1) / self.stores

    def trial_end(self, clock: int, pages: int) -> float:
        """The access before which a page unread since stored is past its trial, with this
        many pages on disk."""
        return clock - self.span(PROBATION * pages, clock)

    @property
    def order(self) -> str:
        return ORDERS[self.follow]

    def choose(self, pages: int, clock: int) -> int:
        """A plan starts with `pages` on disk at access `clock`: the order to follow."""
        self.mini.size(pages, clock)
        if self.fixed is not None:
            self.follow = self.fixed
            return self.follow
        best = switched(self.mini.hits, self.follow)
        if best != self.follow:
            log.info(
                "eviction order changed",
                extra={"order": ORDERS[best], "was": ORDERS[self.follow], "hits": self.scores()},
            )
            self.follow = best
        return self.follow

    def scores(self) -> dict[str, float]:
        """Each miniature's recent hit ratio (for logs, the model file and tests)."""
        return {n: round(r, 4) for n, r in zip(ORDERS, self.mini.ratios(), strict=True)}

    def state(self) -> dict[str, Any]:
        """What the model file keeps besides the miniatures' pages (`table`)."""
        return {
            "kind": KIND,
            "orders": list(ORDERS),
            "follow": self.follow,
            "stores": [self.stores, self.stores_since],
            "mini": self.mini.state(),
        }

    def table(self) -> array[int]:
        """The miniatures' pages, as the model file keeps them."""
        return self.mini.table()

    def restore(self, state: dict[str, Any], table: array[int]) -> None:
        """Take a saved state back; one of another build or other orders is ignored."""
        if state.get("kind") != KIND or state.get("orders") != list(ORDERS):
            log.info("eviction order state of another build ignored; starting from `value`")
            return
        self.follow = int(state["follow"])
        self.stores, self.stores_since = (int(n) for n in state["stores"])
        self.mini.restore(state["mini"], table)
