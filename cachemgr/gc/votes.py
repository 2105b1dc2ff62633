"""The chain model's pending votes, kept only for the pages that hold one.

A vote is the predecessor the last contrary read (or a store after a pause) named for a page
that has none: the hash of its key and its stream's suffix number (cachemgr.gc.chains). Most
pages hold none (none after a scan or a load; in traffic mostly a prompt's first page), so
instead of a column of 9 bytes a slot, the votes sit in an open-addressing table of their own
keyed by slot: three typed arrays (13 bytes a bucket, no Python object a vote), linear probing,
deletion by shifting the buckets after it back (no tombstones to pile up).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

EMPTY = -1  # a bucket holding no slot
_MIN_BITS = 3  # the smallest table: 8 buckets
_FIB = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads slots that come at a stride (heads)
_WORD = (1 << 64) - 1


class Votes:
    """Slot -> (the hash of the key its vote names, its stream's suffix number). Not thread-safe:
    the chain model holds its lock."""

    def __init__(self) -> None:
        self._empty_table(_MIN_BITS, "B")

    def _empty_table(self, bits: int, sfx: str) -> None:
        self.bits = bits  # the table has 2 ** bits buckets
        self.slots = array("i", [EMPTY]) * (1 << bits)
        self.cand = array("q", [0]) * (1 << bits)
        # Suffix numbers count the stream suffixes seen (a few): a byte each, 4 past 255.
        self.sfx = array(sfx, [0]) * (1 << bits)
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def _home(self, s: int) -> int:
        """The first bucket slot `s` may sit in (Fibonacci hashing: the top bits of s × φ)."""
        return ((s * _FIB) & _WORD) >> (64 - self.bits)

    def _find(self, s: int) -> int:
        """The bucket holding slot `s`, or the empty one where it would go."""
        slots, mask = self.slots, len(self.slots) - 1
        i = ((s * _FIB) & _WORD) >> (64 - self.bits)  # (_home, inline: every event may ask)
        while (t := slots[i]) != s and t != EMPTY:
            i = (i + 1) & mask
        return i

    def get(self, s: int) -> tuple[int, int] | None:
        """Slot `s`'s vote, or None."""
        if not self.count:
            return None
        i = self._find(s)
        return None if self.slots[i] == EMPTY else (self.cand[i], self.sfx[i])

    def put(self, s: int, cand: int, sfx: int) -> None:
        """Give slot `s` this vote (in place of any it held)."""
        if 4 * (self.count + 1) > 3 * len(self.slots):
            self._resize(self.bits + 1)
        i = self._find(s)
        if self.slots[i] == EMPTY:
            self.slots[i] = s
            self.count += 1
        self.cand[i] = cand
        try:
            self.sfx[i] = sfx
        except OverflowError:
            self.sfx = array("i", self.sfx)
            self.sfx[i] = sfx

    def drop(self, s: int) -> None:
        """Slot `s` holds no vote (whether or not it held one)."""
        if not self.count:
            return
        i = self._find(s)
        if self.slots[i] == EMPTY:
            return
        self._empty(i)
        self.count -= 1
        if self.bits > _MIN_BITS and 8 * self.count < len(self.slots):
            self._resize(self.bits - 1)  # (a burst of votes gone: its room goes too)

    def _empty(self, i: int) -> None:
        """Empty bucket `i`, moving back each later bucket of its run that may sit there (its
        home is not between `i` and where it sits), so that probes never stop short of it."""
        slots, cand, sfx, mask = self.slots, self.cand, self.sfx, len(self.slots) - 1
        j = i
        while (t := slots[j := (j + 1) & mask]) != EMPTY:
            if (j - self._home(t)) & mask >= (j - i) & mask:
                slots[i], cand[i], sfx[i] = t, cand[j], sfx[j]
                i = j
        slots[i] = EMPTY

    def drop_if(self, gone: Callable[[int], bool]) -> None:
        """Drop the votes of every slot for which `gone` holds: one pass over the table."""
        kept = [v for v in self._votes() if not gone(v[0])]
        if len(kept) < self.count:
            self._refill(kept, self.bits)

    def _votes(self) -> list[tuple[int, int, int]]:
        """(slot, cand, sfx) of every vote."""
        return [(s, self.cand[i], self.sfx[i]) for i, s in enumerate(self.slots) if s != EMPTY]

    def _resize(self, bits: int) -> None:
        self._refill(self._votes(), bits)

    def _refill(self, votes: list[tuple[int, int, int]], bits: int) -> None:
        """The table of 2 ** bits buckets (or more, to hold them) holding just these votes."""
        while bits > _MIN_BITS and 8 * len(votes) < 1 << bits:
            bits -= 1
        while 4 * len(votes) > 3 << bits:
            bits += 1
        self._empty_table(bits, self.sfx.typecode)
        for s, cand, sfx in votes:
            i = self._find(s)
            self.slots[i], self.cand[i], self.sfx[i] = s, cand, sfx
        self.count = len(votes)
