"""Simple online peers for bench/sim_policy.py (page-level, as the simulator serves pages):
S3-FIFO and ARC. Both see what SGLang's evictor would: reads (hits), writes (misses filled),
skipped writes (a page on disk behind a gap: `set` only checks that it exists).

* `S3Fifo` (Yang et al., SOSP'23): a small FIFO (10% of the cap) takes new pages; one not hit
  while there leaves for a ghost list, one hit moves to the main FIFO, which evicts with a
  2-bit frequency (a page hit is reinserted once per hit, up to 3). A page in the ghost list
  that is written again goes straight to the main FIFO.
* `Arc` (Megiddo & Modha, FAST'03): recency (T1) and frequency (T2) lists with ghosts (B1,
  B2) steering the target size p of T1. The simulator asks for victims before the write that
  needs room, so a ghost hit adapts p after that eviction, not before it (one write's lag).
"""

from __future__ import annotations

from collections import OrderedDict

SMALL = 0.1  # S3-FIFO's small queue, as a share of the cap
FREQ_MAX = 3


class Policy:
    """What the evictor sees: reads (hits), writes, skipped writes, a restart; it picks victims."""

    name = ""

    def read(self, page: int, i: int) -> None: ...

    def write(self, page: int, i: int) -> None: ...

    def skip(self, page: int, i: int) -> None: ...

    def restart(self, i: int) -> None: ...

    def victims(self, n: int, i: int, disk: set[int]) -> list[int]:
        raise NotImplementedError


class S3Fifo(Policy):
    name = "s3-fifo"

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.small: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.main: OrderedDict[int, None] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.freq: dict[int, int] = {}

    def read(self, page: int, i: int) -> None:
        self.freq[page] = min(self.freq.get(page, 0) + 1, FREQ_MAX)

    skip = read

    def write(self, page: int, i: int) -> None:
        self.freq[page] = 0
        if self.ghost.pop(page, 0) is None:
            self.main[page] = None
        else:
            self.small[page] = None

    def victims(self, n: int, i: int, disk: set[int]) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            if self.small and (len(self.small) >= SMALL * self.cap or not self.main):
                page, _ = self.small.popitem(last=False)
                if self.freq[page] > 0:
                    self.freq[page] = 0
                    self.main[page] = None
                    continue
                self.ghost[page] = None
                if len(self.ghost) > self.cap - SMALL * self.cap:
                    self.ghost.popitem(last=False)
            else:
                page, _ = self.main.popitem(last=False)
                if self.freq[page] > 0:
                    self.freq[page] -= 1
                    self.main[page] = None
                    continue
            del self.freq[page]
            out.append(page)
        return out


class Arc(Policy):
    name = "arc"

    def __init__(self, cap: int) -> None:
        self.c = cap
        self.p = 0.0
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()

    def read(self, page: int, i: int) -> None:
        if self.t1.pop(page, 0) is None or self.t2.pop(page, 0) is None:
            self.t2[page] = None

    skip = read

    def write(self, page: int, i: int) -> None:
        if page in self.b1:
            self.p = min(self.c, self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[page]
            self.t2[page] = None
        elif page in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[page]
            self.t2[page] = None
        else:
            self.t1[page] = None
            if len(self.t1) + len(self.b1) > self.c and self.b1:
                self.b1.popitem(last=False)
            total = len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2)
            if total > 2 * self.c and self.b2:
                self.b2.popitem(last=False)

    def victims(self, n: int, i: int, disk: set[int]) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            if self.t1 and (len(self.t1) > self.p or not self.t2):
                page, _ = self.t1.popitem(last=False)
                self.b1[page] = None
            else:
                page, _ = self.t2.popitem(last=False)
                self.b2[page] = None
            out.append(page)
        return out
