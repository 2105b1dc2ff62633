"""Bulk work on millions of items in slices, so that another thread takes the GIL between them.

One C call over a list holds the GIL for all of its items: `sum` of a million numbers, or
freeing a million tuples (~0.1 s; an eviction plan over 10M pages kept a `/metrics` scrape
waiting for up to 1.8 s). The interpreter hands the GIL over only between bytecodes
(sys.setswitchinterval), so these loop over slices of SLICE items, a few ms each.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any, TypeVar

SLICE = 1 << 16

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
