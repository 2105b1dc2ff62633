"""The eviction order over learned chains: tails before heads, least valuable chains first.

Only a *leaf* may go (a page no page on disk continues), so what stays is always a usable
prefix. Leaves are grouped into *segments*: the leaf and its ancestors up to the first page
shared with another chain (a branch point such as the end of a system prompt). All pages of a
segment are read together (a request reads its whole prefix), so they share one value:

    value = (1 - END) × P(alive) × rate   (expected hits per page per access-sequence step)

from its top page (its reads count every return of the chain; cachemgr.gc.history gives an
evicted chain that comes back its record again):

* rate: returns are Poisson with a rate drawn from a Gamma prior fitted to all segments
  (empirical Bayes, cachemgr.gc.returns); after n returns in `span` steps and `silence`
  steps without one, its mean is (α + n) / (β + span + silence);
* P(alive): a conversation ends at any return with probability END (it moves on to a new
  chain); with q the chance of no return in the silence, q / (q + END · (1 - q)).

Segments go lowest value first, each leaf to top; a segment gone exposes its branch point as a
leaf, whose segment is valued in turn. Pages whose predecessor is known and gone (confirmed by
a read, or never read since they were written behind it) are unusable (SGLang stops at the
gap): they go first. The clock is the access
sequence, so the order is the same at any request rate. Measured against LRU and a clairvoyant
bound in bench/sim_policy.py.

That is the `value` order; the same segments are also ranked by recency alone and with a
probation queue for pages never read, and the model follows whichever of the three has the
best hit ratio lately as a miniature cache on a sample of the keys (cachemgr.gc.adapt).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Iterator
from heapq import heappop, heappush, merge
from struct import Struct
from typing import NamedTuple

from cachemgr.gc import _rank
from cachemgr.gc.adapt import ORDERS
from cachemgr.gc.chains import CYCLE_WALK, IN_FLIGHT_SECONDS, ChainModel
from cachemgr.gc.pagestore import GHOST, NONE, PageStore
from cachemgr.gc.returns import Moments, fitted, moments, worth
from cachemgr.gil import GiveWay, release

CACHED = 16  # pages a segment has at least for the next order to read it, not walk it


class Victim(NamedTuple):
    """One page to evict: every file of it goes together."""

    namespace_id: str
    key: str
    names: tuple[str, ...]
    size: int
    last_time: float


# A segment ranked, as a plain tuple (the cyclic garbage collector stops tracking those, not a
# NamedTuple): its key in the order followed, its latest use, that use's wall clock (what
# orders pages only a scan saw, seq 0), its leaf's position in the round's leaves (ties go in
# leaf order), its leaf, and its path: slots, leaf first, as an int array's bytes (neither an
# int object per page, which in a million-page order outlived it in RSS, nor an object the
# collector tracks); None: the whole segment, walked when it goes.
_Ranked = tuple[float, int, float, int, int, bytes | None]
_KEY = Struct("3d")  # cachemgr.gc._rank's keys: (key, last, when) a segment
RECENCY, PROBATION = ORDERS.index("recency"), ORDERS.index("probation")
_MODES = {RECENCY: 1, PROBATION: 2}  # _rank.rank's mode of each order (0: the value)


def eviction_order(
    model: ChainModel,
    namespace_ids: Iterable[str] | None = None,
    *,
    before: float,
    now: float = math.inf,
    protect: bool = True,
) -> Iterator[Victim]:
    """Pages of these namespaces (None: all) in the order to evict them, none of them used
    after `before` (wall clock, min_age) and none before a page still in use after it, nor
    one a request being served may still write behind at wall-clock time `now` (`in_flight`).
    Not `protect`: every page, in the same order but for those protections.

    Segments are ranked by the order the model follows, chosen as the order starts by the
    orders' miniature caches (cachemgr.gc.adapt; `protect` only: the unprotected pass after a
    protected one keeps its choice).
    Lazy: segments are valued when the previous ones are used up; the caller stops when it
    has enough. Holds the model's lock while it is consumed.
    """
    with model.lock:
        # (the store once the lock is held: a restore waited for replaces it, and closes the
        # file of the keys of the one it replaces)
        st = model.store
        gone: dict[int, int] = {}  # slot -> its children already in the order
        leaves = _leaves(st, namespace_ids)
        held = in_flight(model, now) if protect else set()
        before = before if protect else math.inf
        _settle(model)
        cache: dict[int, tuple[int, int, float]] | None = model.segments
        follow = model.adapt.choose(st.count, model.clock) if protect else model.adapt.follow
        while leaves:
            exposed: list[int] = []
            yield from _in_order(
                st, _segments(model, leaves, gone, before, held, cache, follow), gone, exposed
            )
            leaves, cache = array("i", exposed), None  # (later rounds: segments gone, walked)


def _leaves(st: PageStore, namespace_ids: Iterable[str] | None) -> array[int]:
    """The slots of the leaves of these namespaces (None: all), in slot order."""
    wanted = None
    if namespace_ids is not None:
        wanted = bytearray(len(st.ns_names))
        for ns in namespace_ids:
            if ns in st.ns_num:
                wanted[st.ns_num[ns]] = 1
    out = array("i")
    out.frombytes(_rank.leaf_slots(st.leaf, st.ns, wanted))
    return out


def _in_order(
    st: PageStore, segments: Iterator[_Ranked], gone: dict[int, int], exposed: list[int]
) -> Iterator[Victim]:
    """The segments' pages, each leaf to top; each page left a leaf by them goes to
    `exposed`."""
    give_way = GiveWay()
    for *_, leaf, walked in segments:
        path = _path(st, leaf, walked)
        for s in path:
            give_way()
            key = st.key(s)  # (a read of the key file: cachemgr.gil.GiveWay says why)
            yield Victim(st.ns_names[st.ns[s]], key, st.names(s, key), st.size(s), st.time[s])
        up = st.pred[path[-1]]
        if up != NONE:
            gone[up] = gone.get(up, 0) + 1
            if gone[up] == st.kids[up] and st.files[up] != GHOST:
                exposed.append(up)  # its last child went: its segment is next


def _path(st: PageStore, leaf: int, walked: bytes | None) -> array[int]:
    if walked is None:  # (all its pages go: nothing in it is young or in flight)
        return _walk(st, leaf, {}, math.inf, set())[0]
    return array("i", walked)


def cap_order(
    model: ChainModel,
    namespace_ids: Iterable[str] | None = None,
    *,
    before: float,
    now: float = math.inf,
) -> Iterator[tuple[Victim, bool]]:
    """What keeping a limit may take, as (victim, whether a protection yields for it): the
    eviction order, then the whole order again without its protections (min_age, in flight),
    so that a caller who needs more bytes than the unprotected pages hold always finds them:
    protections reorder victims, they never stop the cap. The second pass repeats the pages
    of the first: the caller skips those it took."""
    ids = None if namespace_ids is None else list(namespace_ids)
    for v in eviction_order(model, ids, before=before, now=now):
        yield v, False
    for v in eviction_order(model, ids, before=before, now=now, protect=False):
        yield v, True


def in_flight(model: ChainModel, now: float) -> set[int]:
    """The pages a request being served may still write behind: on each stream (a rank's
    files), the page accessed last, if that was among the model's last `in_flight` accesses
    (at most a tenth of the pages: a small cache must still meet its cap) and less than
    IN_FLIGHT_SECONDS before `now`, and its ancestors (its request's prefix). One walk per
    stream, not one per page read: not every recent read is a request still running."""
    st = model.store
    floor = model.clock - min(model.in_flight, st.count // 10)
    held: set[int] = set()
    for (ns, *_), key in model.last_pages():
        at = st.find(ns, key)
        if not st.present(at) or st.last[at] <= floor or st.time[at] <= now - IN_FLIGHT_SECONDS:
            continue
        for _ in range(CYCLE_WALK):
            if at == NONE or at in held or st.files[at] == GHOST:
                break
            held.add(at)
            at = st.pred[at]
    return held


def _settle(model: ChainModel) -> None:
    """Forget the segments that changed since the last order: the segment of each page
    changed is found down its single children (the XOR of a page's children is its child)."""
    st, cache = model.store, model.segments
    seen: set[int] = set()
    for s in model.dirty:
        cache.pop(s, None)  # (it is no leaf any more, or its segment changed)
        while st.kids[s] == 1 and s not in seen:
            seen.add(s)
            s = st.kidx[s]
        cache.pop(s, None)
    model.dirty.clear()


def _segments(
    model: ChainModel,
    leaves: array[int],
    gone: dict[int, int],
    before: float,
    held: set[int],
    cache: dict[int, tuple[int, int, float]] | None,
    order: int,
) -> Iterator[_Ranked]:
    """The segments of these leaves that may go, lowest (key in `order`, last, when) first,
    ties in leaf order, found lazily: the caller stops when it has freed enough. `cache`: the
    segments known of the last order (whole, none gone), read instead of walked, and kept.

    A leaf no page precedes (a scan's page: every page of a restarted daemon) is a segment of
    one page: those are split off, valued and sorted in C without the GIL (cachemgr.gc._rank:
    at 10M pages, ~33 s of Python and ~1.5 GB of tuples before the first victim). The others
    are walked here and heaped a push at a time (one sort of a mass eviction's segments is a
    single C call holding the GIL for hundreds of ms), and the two merged."""
    st, clock = model.store, model.clock
    one, chained, sums = _rank.split(
        leaves, st.pred, st.time, before, array("i", sorted(held)), st.reads, st.born, clock
    )
    raw = _walked(model, leaves, array("i", chained), gone, before, held, cache)
    reads, born = st.reads, st.born
    # (A birth after the last use, from an index edited or damaged, counts as none: a negative
    # exposure would make the prior's rate, and so the value, meaningless or undefined.)
    chains = ((reads[top], max(clock - born[top], 0)) for _, _, _, top, _, _, _ in raw)
    fitted_ = fitted(moments(chains, Moments(*sums)))
    # Pages not read since they were written are on trial for the accesses in which
    # PROBATION of the pages on disk are stored (S3-FIFO's small queue); then `probation`
    # takes them first.
    trial_end = model.adapt.trial_end(clock, st.count)
    mode = _MODES.get(order, 0)
    keys, ranked = _rank.rank(
        one, leaves, reads, born, st.last, st.time, clock, trial_end, mode, *fitted_
    )
    segments: list[_Ranked] = []
    for at, leaf, walked, top, last, when, stranded in raw:
        if stranded:
            key = -1.0
        elif order == RECENCY:
            key = 0.0
        elif order == PROBATION and not reads[top] and last < trial_end:
            key = -0.5
        else:
            key = worth(fitted_, reads[top], max(last - born[top], 0), clock - last)
        segments.append((key, last, when, at, leaf, walked))
    release(raw)
    try:
        yield from merge(_one_page(leaves, one, keys, ranked), _lowest_first(segments))
    finally:  # the caller took what it needed: most of a mass eviction's are left
        release(segments)


def _walked(
    model: ChainModel,
    leaves: array[int],
    chained: array[int],
    gone: dict[int, int],
    before: float,
    held: set[int],
    cache: dict[int, tuple[int, int, float]] | None,
) -> list[tuple[int, int, bytes | None, int, int, float, bool]]:
    """The segments of the leaves at these positions (each continues a page), as (position,
    leaf, its path's bytes or None for all of it, top, last, when, stranded)."""
    st = model.store
    raw: list[tuple[int, int, bytes | None, int, int, float, bool]] = []
    for at in chained:
        leaf = leaves[at]
        known = cache.get(leaf) if cache is not None else None
        if known is not None:
            top, last, when = known
            if when <= before and top not in held:  # none is young (held: its top is too)
                stranded = st.below_gap(top) and _cut_off(st, top)
                raw.append((at, leaf, None, top, last, when, stranded))
                continue
        path, top, last, stranded = _walk(st, leaf, gone, before, held)
        if path:
            when = max(st.time[p] for p in path)
            raw.append((at, leaf, path.tobytes(), top, last, when, stranded))
            if cache is not None and len(path) > CACHED and path[-1] == top:
                cache[leaf] = (top, last, when)  # (the whole segment: none of it is young)
    return raw


def _one_page(leaves: array[int], one: bytes, keys: bytes, ranked: bytes) -> Iterator[_Ranked]:
    """The one-page segments `_rank.rank` sorted, as (key, last, when, position, leaf, None)."""
    positions = memoryview(one).cast("i")
    for j in memoryview(ranked).cast("i"):
        key, last, when = _KEY.unpack_from(keys, j * _KEY.size)
        at = positions[j]
        yield key, int(last), when, at, leaves[at], None


def _lowest_first(segments: list[_Ranked]) -> Iterator[_Ranked]:
    """The segments lowest (key, last, when, position) first, found lazily.

    Neither step holds the GIL long while another thread waits for it (a /metrics scrape):
    the heap grows one push at a time, where one sort or heapify of a mass eviction's 250,000
    segments is a single C call of hundreds of ms; and it holds plain tuples of numbers (and
    bytes), which the cyclic garbage collector stops tracking, where 250,000 live
    NamedTuples (or lists) would each make its full collections, which hold the GIL too, that
    much longer (bench/RESULTS.md)."""
    heap: list[tuple[float, int, float, int, int]] = []
    try:
        for i, (key, last, when, at, _, _) in enumerate(segments):
            heappush(heap, (key, last, when, at, i))
        while heap:
            yield segments[heappop(heap)[4]]
    finally:
        release(heap)


def _cut_off(st: PageStore, top: int) -> bool:
    """Whether a segment's top page, its predecessor gone, is cut off by it (stranded: it goes
    first). GC never evicts a page before its children, so a deletion racing the request that
    wrote it (or read it) cut it off; a link no read contradicted since is trusted for that:
    one confirmed by reads, or the page's own, never read since it was written behind it."""
    return st.conf[top] > 0 or st.reads[top] == 0


def _walk(
    st: PageStore,
    leaf: int,
    gone: dict[int, int],
    before: float,
    held: set[int],
) -> tuple[array[int], int, int, bool]:
    """The leaf's segment: (the pages that may go, leaf first; its top page; its latest use;
    stranded). A page used after `before` (wall clock) or in flight (`held`) stays, and so
    does everything above it."""
    pred, files, kids, last_col, time_col = st.pred, st.files, st.kids, st.last, st.time
    path = array("i")
    young = False
    last = last_col[leaf]
    at = leaf
    while True:
        t = time_col[at]
        young = young or t > before or at in held
        if not young:
            path.append(at)
        last = max(last, last_col[at])
        above = pred[at]
        if above == NONE:
            return path, at, last, False
        if files[above] == GHOST:
            # Its predecessor is gone: nothing below the gap can be loaded.
            return path, at, last, _cut_off(st, at) and not young
        if kids[above] - gone.get(above, 0) != 1:
            return path, at, last, False  # a branch point: the segment ends below it
        at = above
