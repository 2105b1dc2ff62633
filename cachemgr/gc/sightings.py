"""Which temp files a fleet's GC leader has seen unchanged for tmp_ttl by its own clock.

On a shared filesystem a temp file's mtime is another clock than the leader's: the file
server's (NFS) or the writing node's (CephFS). With that clock behind the leader's by more
than tmp_ttl, every temp being written looked stale, and the leader's sweep deleted pages
under their writers on other nodes. So in a fleet a temp is stale only once the leader has
seen it, by size and mtime, unchanged for tmp_ttl of its monotonic clock (and its mtime is
that old too, as on one node). A new leader sees each temp afresh: it deletes leftovers one
sweep later than the last leader would have.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar


class Sighted(Protocol):
    """A temp file as a sweep lists it."""

    @property
    def where(self) -> str: ...  # its dir, relative to the root

    @property
    def name(self) -> str: ...

    @property
    def size(self) -> int: ...

    @property
    def mtime(self) -> float: ...


T = TypeVar("T", bound=Sighted)
U = TypeVar("U", bound=Sighted)


@dataclass
class TempSightings:
    """(dir, name) -> (size, mtime, when first seen so) of each temp the last sweep listed."""

    clock: Callable[[], float] = time.monotonic
    _first: dict[tuple[str, str], tuple[int, float, float]] = field(default_factory=dict)

    def settled(self, temps: Sequence[T], own: Sequence[U], ttl: float) -> tuple[list[T], list[U]]:
        """Of a sweep's engine temps and cachemgr's own, those unchanged for `ttl` seconds;
        what the sweep did not list is forgotten."""
        now = self.clock()
        first: dict[tuple[str, str], tuple[int, float, float]] = {}
        for t in [*temps, *own]:
            key = (t.where, t.name)
            size, mtime, at = self._first.get(key, (t.size, t.mtime, now))
            first[key] = (t.size, t.mtime, at if (size, mtime) == (t.size, t.mtime) else now)
        self._first = first

        def unchanged(t: Sighted) -> bool:
            return now - first[(t.where, t.name)][2] >= ttl

        return [t for t in temps if unchanged(t)], [t for t in own if unchanged(t)]
