"""Bulk work on millions of items in slices, so that another thread takes the GIL between them.

One C call over a list holds the GIL for all of its items: `sum` of a million numbers, or
freeing a million tuples (~0.1 s; an eviction plan over 10M pages kept a `/metrics` scrape
waiting for up to 1.8 s). The interpreter hands the GIL over only between bytecodes
(sys.setswitchinterval), so these loop over slices of SLICE items, a few ms each.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any, TypeVar

SLICE = 1 << 16
# A loop that makes a syscall per item (a key file's pread) gives the GIL up at each one, and
# takes it back before a waiting thread has woken: that thread's wait starts again at every
# give-up and never times out into a switch request, so it waits for the whole loop (an
# eviction plan over a million vLLM blocks kept /metrics waiting 117-178 ms). Such a loop
# sleeps PAUSE every EVERY seconds: long enough for the waiting thread to wake and take it.
EVERY = 0.003
PAUSE = 0.0001

T = TypeVar("T")


def release(items: list[Any]) -> None:
    """Empty `items` a slice at a time, from its end (nothing shifts)."""
    while items:
        del items[-SLICE:]


def slices(items: Iterable[T]) -> Iterator[list[T]]:
    """`items` as lists of SLICE items at most."""
    it = iter(items)
    while part := list(islice(it, SLICE)):
        yield part


clock: Callable[[], float] = time.monotonic
nap: Callable[[float], None] = time.sleep


class GiveWay:
    """Called once an item by such a loop: naps PAUSE once EVERY seconds have passed."""

    def __init__(self) -> None:
        self.due = clock() + EVERY

    def __call__(self) -> None:
        if clock() >= self.due:
            nap(PAUSE)
            self.due = clock() + EVERY
