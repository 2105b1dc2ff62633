"""The eviction order over learned chains: tails before heads, least valuable chains first.

Only a *leaf* may go (a page no page on disk continues), so what stays is always a usable
prefix. Leaves are grouped into *segments*: the leaf and its ancestors up to the first page
shared with another chain (a branch point such as the end of a system prompt). All pages of a
segment are read together (a request reads its whole prefix), so they share one value:

    value = rate × P(alive)

* rate: the segment's uses per access-sequence step, (returns + 1) / (last - first + b), from
  its top page (its reads count every return of the chain); b, the prior, is the mean interval
  between returns over all segments that came back, so a chain seen once is worth about one
  typical return;
* P(alive): a conversation ends at any return with probability END (it moves on to a new
  chain); a chain silent for longer than its rate makes likely has probably ended: the posterior
  after silence s is 1 / (1 + END/(1-END) · e^(rate·s)).

Segments go lowest value first, each leaf to top; a segment gone exposes its branch point as a
leaf, whose segment is valued in turn. Pages whose predecessor is known and gone (confirmed by
a read, or never read since they were written behind it) are unusable (SGLang stops at the
gap): they go first. The clock is the access
sequence, so the order is the same at any request rate. Measured against LRU and a clairvoyant
bound in bench/sim_policy.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from cachemgr.gc.chains import IN_FLIGHT_SECONDS, ChainModel, Page, PageId

END = 0.1  # prior probability that a conversation ends at a return
_MAX_EXP = 700.0  # e^700 is near float's limit: the chain is as good as ended


class Victim(NamedTuple):
    """One page to evict: every file of it goes together."""

    namespace_id: str
    key: str
    names: tuple[str, ...]
    size: int
    last_time: float


class _Segment(NamedTuple):
    value: float
    last: int
    when: float  # wall clock of its latest use: what orders pages only a scan saw (seq 0)
    path: list[PageId]  # leaf first


def eviction_order(
    model: ChainModel,
    namespace_ids: Iterable[str] | None = None,
    *,
    before: float,
    now: float = math.inf,
) -> Iterator[Victim]:
    """Pages of these namespaces (None: all) in the order to evict them, none of them used
    after `before` (wall clock, min_age) and none before a page still in use after it, nor
    one in flight at wall-clock time `now` (cachemgr.gc.chains.IN_FLIGHT).

    Lazy: segments are valued when the previous ones are used up; the caller stops when it
    has enough. Holds the model's lock while it is consumed.
    """
    wanted = None if namespace_ids is None else set(namespace_ids)
    with model.lock:
        gone: dict[PageId, int] = {}  # page -> its children already in the order
        leaves = [p for p in model.leaves if wanted is None or p[0] in wanted]
        # In flight: the last accesses, at most a tenth of the pages (a small cache must still
        # be able to meet its cap when the writer stops).
        recent = (model.clock - min(model.in_flight, len(model.pages) // 10),
                  now - IN_FLIGHT_SECONDS)  # fmt: skip
        while leaves:
            exposed: list[PageId] = []
            for seg in _segments(model, leaves, gone, before, recent):
                for pid in seg.path:
                    page = model.pages[pid]
                    yield Victim(pid[0], pid[1], page.names(pid[1]), page.size, page.last_time)
                above = model.pages[seg.path[-1]].pred
                if above is not None:
                    up = (seg.path[-1][0], above)
                    gone[up] = gone.get(up, 0) + 1
                    if gone[up] == model.kids.get(up, 0) and up in model.pages:
                        exposed.append(up)  # its last child went: its segment is next
            leaves = exposed


def _segments(
    model: ChainModel,
    leaves: list[PageId],
    gone: dict[PageId, int],
    before: float,
    recent: tuple[int, float],
) -> list[_Segment]:
    """The segments of these leaves that may go, in the order to evict them."""
    raw: list[tuple[list[PageId], Page, int, bool]] = []
    for leaf in leaves:
        path, top, last, stranded = _walk(model, leaf, gone, before, recent)
        if path:
            raw.append((path, top, last, stranded))
    returns = [(last - top.born, top.reads) for _, top, last, _ in raw if top.reads > 0]
    prior = sum(d for d, _ in returns) / sum(n for _, n in returns) if returns else 1.0
    odds, clock = END / (1 - END), model.clock
    out = []
    for path, top, last, stranded in raw:
        when = max(model.pages[p].last_time for p in path)
        if stranded:
            out.append(_Segment(-1.0, last, when, path))
            continue
        rate = (top.reads + 1) / (last - top.born + max(prior, 1.0))
        silence = rate * (clock - last)
        alive = 0.0 if silence > _MAX_EXP else 1 / (1 + odds * math.exp(silence))
        out.append(_Segment(rate * alive, last, when, path))
    out.sort(key=lambda s: (s.value, s.last, s.when))
    return out


def _walk(
    model: ChainModel,
    leaf: PageId,
    gone: dict[PageId, int],
    before: float,
    recent: tuple[int, float],
) -> tuple[list[PageId], Page, int, bool]:
    """The leaf's segment: (the pages that may go, leaf first; its top page; its latest use;
    stranded). A page used after `before` (wall clock) or in flight (used after access
    `recent[0]` and after time `recent[1]`) stays, and so does everything above it."""
    pages = model.pages
    page = pages[leaf]
    path: list[PageId] = []
    young = False
    last = page.last
    at = leaf
    while True:
        young = (
            young
            or page.last_time > before
            or (page.last > recent[0] and page.last_time > recent[1])
        )
        if not young:
            path.append(at)
        last = max(last, page.last)
        if page.pred is None:
            return path, page, last, False
        above_id = (at[0], page.pred)
        above = pages.get(above_id)
        if above is None:
            # Its predecessor is gone: nothing below the gap can be loaded. GC never evicts a
            # page before its children, so a deletion racing the request that wrote it (or
            # read it) cut it off; a link no read contradicted since is trusted for that.
            return path, page, last, (page.conf > 0 or page.reads == 0) and not young
        if model.kids.get(above_id, 0) - gone.get(above_id, 0) != 1:
            return path, page, last, False  # a branch point: the segment ends below it
        at, page = above_id, above
