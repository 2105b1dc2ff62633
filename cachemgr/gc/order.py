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

GC evicts pages, not files: every file of one page (an extra pool's part, each rank's file:
cachemgr.backends) goes together, and a page is as recent as its most recently used file (a
pool read only for a prefix's last page must not drag the page's hot KV file out early).
"""

from __future__ import annotations

import heapq
import sqlite3
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from cachemgr.state import pages_sql


class Candidate(NamedTuple):
    """One page that may be evicted, with what the index knows of its use."""

    last_access: float  # of its most recently used file
    access_seq: int
    namespace_id: str
    names: tuple[str, ...]  # all its files
    size: int  # of all its files
    reads: int  # of its most read file


_DONE = (float("inf"), 0)  # a page already yielded: its other files are skipped


def _pages(conn: sqlite3.Connection, ns_id: str, before: float) -> Iterator[Candidate]:
    """The pages of `ns_id` last used at or before `before`, least recently used first.

    Files stream by recency; a page is yielded when its most recent file comes by, so a page
    with a file used after `before` never is. Memory: the pages of several files seen so far.
    """
    cur = pages_sql.files_by_recency(conn, ns_id, before)
    due: dict[str, tuple[float, int]] = {}  # key -> recency of its page, once looked up
    for last, seq, name, key_len, size, reads, count in cur:
        if count == 1:  # most pages: no other file to wait for or take along
            yield Candidate(last, seq, ns_id, (name,), size, reads)
            continue
        key = name[:key_len]
        when = due.get(key)
        if when is not None and when != (last, seq):
            continue  # comes later, or came already
        files = pages_sql.page_files(conn, ns_id, key)
        top = max((f[2], f[3]) for f in files)
        if top != (last, seq):
            due[key] = top
            continue
        due[key] = _DONE
        yield Candidate(
            last, seq, ns_id, tuple(f[0] for f in files), sum(f[1] for f in files),
            max(f[4] for f in files),
        )  # fmt: skip


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
    streams = [_pages(conn, ns, before) for ns in sorted(set(namespace_ids))]
    merged = heapq.merge(*streams, key=lambda c: (c.last_access, c.access_seq))
    yield from order_stream(merged, gap=gap, span=span)


def order_stream(stream: Iterable[Candidate], *, gap: float, span: float) -> Iterator[Candidate]:
    """A stream of pages, least recently used first, in the order to evict them (the policy
    alone, without the index: bench/sim_policy.py runs it on a simulated trace)."""
    for burst in bursts(stream, gap, span):
        burst.sort(key=_within_burst)
        yield from burst
