"""Chain-aware LRU: the order in which GC evicts pages of live namespaces.

SGLang loads the longest *contiguous* prefix of a request's pages, so a page is useful only
while every earlier page of its chain is on disk. A request reads its prefix front to back, so
plain LRU by last read drops the chain's head first and strands the rest (FIELD_NOTES §5).
The index does not know the chains, but it knows the order of accesses. Here:

* accesses are grouped into bursts (gaps under `burst_gap`, at most `burst_span` long): one
  request's reads and writes land in one burst;
* bursts go oldest first, as in LRU;
* inside a burst, pages read fewer times go first, then later-accessed before earlier ones.
  A chain's head is read at least as often as its tail (reading the tail means reading the
  head) and before it, so tails go before heads, and pages shared by many sessions (the
  system prompt) go last.
"""

from __future__ import annotations

import heapq
import sqlite3
from collections.abc import Iterable, Iterator
from typing import NamedTuple


class Candidate(NamedTuple):
    """One page that may be evicted, with what the index knows of its use."""

    last_access: float
    access_seq: int
    namespace_id: str
    name: str
    size: int
    reads: int


def _rows(conn: sqlite3.Connection, ns_id: str, before: float) -> Iterator[Candidate]:
    cur = conn.execute(
        "SELECT last_access, access_seq, namespace_id, name, size, reads FROM pages"
        " WHERE namespace_id = ? AND last_access <= ? ORDER BY last_access, access_seq",
        (ns_id, before),
    )
    return (Candidate(*row) for row in cur)


def bursts(stream: Iterable[Candidate], gap: float, span: float) -> Iterator[list[Candidate]]:
    """Split a recency-ordered stream into bursts of accesses close together in time."""
    burst: list[Candidate] = []
    for c in stream:
        if burst and (
            c.last_access - burst[-1].last_access > gap
            or c.last_access - burst[0].last_access > span
        ):
            yield burst
            burst = []
        burst.append(c)
    if burst:
        yield burst


def _within_burst(c: Candidate) -> tuple[int, float, int]:
    return (c.reads, -c.last_access, -c.access_seq)


def eviction_order(
    conn: sqlite3.Connection,
    namespace_ids: Iterable[str],
    *,
    before: float,
    gap: float,
    span: float,
) -> Iterator[Candidate]:
    """Pages of these namespaces last used at or before `before`, in the order to evict them.

    Lazy: one index-ordered cursor per namespace, merged; memory is one burst at a time.
    """
    streams = [_rows(conn, ns, before) for ns in sorted(set(namespace_ids))]
    merged = heapq.merge(*streams, key=lambda c: (c.last_access, c.access_seq))
    for burst in bursts(merged, gap, span):
        burst.sort(key=_within_burst)
        yield from burst
