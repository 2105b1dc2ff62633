"""The eviction order over learned chains: tails before heads, least valuable chains first.

Only a *leaf* may go (a page no page on disk continues), so what stays is always a usable
prefix. Leaves are grouped into *segments*: the leaf and its ancestors up to the first page
shared with another chain (a branch point such as the end of a system prompt). All pages of a
segment are read together (a request reads its whole prefix), so they share one value:

    value = rate × P(alive)

* rate: the segment's uses per access-sequence step, (uses - 1 + 1) / (last - first + b), from
  its top page (its reads count every return of the chain); b, the prior, is the mean interval
  between returns over all segments that came back, so a chain seen once is worth about one
  typical return;
* P(alive): a conversation ends at any return with probability END (it moves on to a new
  chain); a chain silent for longer than its rate makes likely has probably ended: the posterior
  after silence s is 1 / (1 + END/(1-END) · e^(rate·s)).

Segments go lowest value first, each leaf to top; a segment gone exposes its branch point as a
leaf, whose segment is valued in turn. Pages whose predecessor is known, confirmed by a read,
and gone are unusable (SGLang stops at the gap): they go first. The clock is the access
sequence, so the order is the same at any request rate. Measured against LRU and a clairvoyant
bound in bench/sim_policy.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from cachemgr.gc.chains import ChainModel, Page, PageId

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
    path: list[PageId]  # leaf first


def eviction_order(
    model: ChainModel, namespace_ids: Iterable[str] | None = None, *, before: float
) -> Iterator[Victim]:
    """Pages of these namespaces (None: all) in the order to evict them, none of them used
    after `before` (wall clock, min_age) and none before a page still in use after it.

    Lazy: segments are valued when the previous ones are used up; the caller stops when it
    has enough. Holds the model's lock while it is consumed.
    """
    wanted = None if namespace_ids is None else set(namespace_ids)
    with model.lock:
        taken: set[PageId] = set()
        while True:
            segments = _segments(model, wanted, taken, before)
            if not segments:
                return
            for seg in segments:
                for pid in seg.path:
                    page = model.pages[pid]
                    taken.add(pid)
                    yield Victim(pid[0], pid[1], tuple(sorted(page.files)), page.size,
                                 page.last_time)  # fmt: skip


def _segments(
    model: ChainModel, wanted: set[str] | None, taken: set[PageId], before: float
) -> list[_Segment]:
    """Every evictable segment, in the order to evict them."""
    pages, now = model.pages, 0
    raw: list[tuple[list[PageId], Page, int, bool]] = []
    for pid, page in pages.items():
        now = max(now, page.last)
        if pid in taken or (wanted is not None and pid[0] not in wanted):
            continue
        if _live_kids(model, pid, taken):
            continue
        path, top, last, stranded = _walk(model, pid, taken)
        # A page used within min_age stays, and so do its ancestors; pages below it may go.
        young = next((i for i, p in enumerate(path) if pages[p].last_time > before), None)
        if young == 0:
            continue
        raw.append((path[:young], top, last, stranded))
    returns = [(last - top.born, top.reads) for _, top, last, _ in raw if top.reads > 0]
    prior = sum(d for d, _ in returns) / sum(n for _, n in returns) if returns else 1.0
    odds = END / (1 - END)
    out = []
    for path, top, last, stranded in raw:
        if stranded:
            out.append(_Segment(-1.0, last, path))
            continue
        rate = (top.reads + 1) / (last - top.born + max(prior, 1.0))
        silence = rate * (now - last)
        alive = 0.0 if silence > _MAX_EXP else 1 / (1 + odds * math.exp(silence))
        out.append(_Segment(rate * alive, last, path))
    out.sort(key=lambda s: (s.value, s.last))
    return out


def _live_kids(model: ChainModel, pid: PageId, taken: set[PageId]) -> bool:
    kids = model.kids.get(pid, ())
    return any((pid[0], k) not in taken for k in kids)


def _walk(
    model: ChainModel, leaf: PageId, taken: set[PageId]
) -> tuple[list[PageId], Page, int, bool]:
    """The leaf's segment: (path leaf first, its top page, latest use, stranded)."""
    pages = model.pages
    path, page = [leaf], pages[leaf]
    last = page.last
    while page.pred is not None:
        pred = (leaf[0], page.pred)
        above = pages.get(pred)
        if above is None or pred in taken:
            # A confirmed link to a page that is gone: nothing below the gap can be loaded.
            return path, page, last, page.conf > 0 and above is None
        if model.children(pred) != 1:
            break
        path.append(pred)
        page = above
        last = max(last, page.last)
    return path, page, last, False
