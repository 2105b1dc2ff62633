"""The eviction order is selected lazily: the same victims as one stable sort of every
segment by (value, last, when), ties included, but a caller that stops after k victims pops k
segments off a heap, never sorts them all, and leaves no object per segment for the cyclic
garbage collector to traverse (both hold the GIL: a /metrics scrape waits behind them)."""

from __future__ import annotations

import gc
import math
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import islice
from types import FrameType

from cachemgr.gc.adapt import ORDERS
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.value import LAST, WHEN, _lowest_first, _segments, eviction_order

SUFFIX = "_Qwen-Qwen3-8B_0_1.bin"
NAMESPACES = ("a" * 16, "b" * 16)


def key(n: int) -> str:
    return f"{n * 2654435761 % (1 << 64):064x}"


def random_model(rng: random.Random) -> ChainModel:
    """Chains, branches, reads, pages removed in the middle; few distinct access times and
    many pages only a scan saw (seq 0), so many segments tie on (value, last, when)."""
    model = ChainModel(in_flight=rng.choice([0, 5]))
    n = rng.randrange(2, 300)
    for i in range(n):
        pred = None if i == 0 or rng.random() < 0.3 else key(rng.randrange(i))
        ns = rng.choice(NAMESPACES)
        seq = rng.choice([0, 0, rng.randrange(1, 40)])
        at = float(rng.randrange(4))
        reads = rng.choice([0, 0, 1, 3])
        model.add_indexed(ns, (key(i) + SUFFIX, 64, 100, at, seq, reads, pred, None))
    for _ in range(rng.randrange(20)):
        model.remove(rng.choice(NAMESPACES), [(key(rng.randrange(n)) + SUFFIX, 64)])
    return model


def test_the_lazy_selection_is_a_stable_sort_of_the_segments() -> None:
    rng = random.Random(13)
    ties = 0
    for _ in range(300):
        model = random_model(rng)
        st = model.store
        before = rng.choice([math.inf, 1.5])
        segments = _segments(model, st.leaves(), {}, before, set(), None)
        for order in range(len(ORDERS)):  # (each order the model may follow)
            expected = sorted(segments, key=lambda s: (s[order], s[LAST], s[WHEN]))
            assert list(_lowest_first(segments, order)) == expected
        ties += len(segments) - len({(s[0], s[LAST], s[WHEN]) for s in segments})
    assert ties > 1000  # the tie-break (the leaves' order) was exercised


def test_every_order_holds_each_page_once_tails_first() -> None:
    rng = random.Random(5)
    for _ in range(100):
        model = random_model(rng)
        order = [(v.namespace_id, v.key) for v in eviction_order(model, before=math.inf)]
        assert sorted(order) == sorted(model.pages)
        at = {pid: i for i, pid in enumerate(order)}
        for (ns, k), page in model.pages.items():
            if page.pred is not None and (ns, page.pred) in at:
                assert at[(ns, page.pred)] > at[(ns, k)]  # a page goes before its predecessor


@contextmanager
def c_calls() -> Iterator[dict[str, int]]:
    """Count the calls of builtin (C) functions made from Python code, by name."""
    counts: dict[str, int] = {}

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "c_call":
            name = getattr(arg, "__name__", "?")
            counts[name] = counts.get(name, 0) + 1

    sys.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(None)


def one_page_segments(n: int) -> ChainModel:
    """A mass eviction's shape: n pages no chain links (seen by a scan), n segments."""
    model = ChainModel()
    for i in range(n):
        model.add(NAMESPACES[0], key(i) + SUFFIX, 64, 100, seq=0, at=float(i * 7919 % n))
    return model


def test_the_first_victims_are_popped_not_sorted() -> None:
    n, k = 20_000, 10
    model = one_page_segments(n)
    with c_calls() as calls:
        order = eviction_order(model, before=math.inf)
        first = [v.key for v in islice(order, k)]
        order.close()  # (the plan has enough)
    assert first == [key(i) for i in sorted(range(n), key=lambda i: i * 7919 % n)[:k]]
    # Each segment pushed once, only the k taken popped, nothing sorted or heapified (a page
    # of several files sorts its own names; these have one each); the other orders are
    # scored by their miniatures, not ranked here.
    assert calls.get("heappush") == n
    assert calls.get("heappop", 0) == k
    assert not {"sort", "sorted", "heapify", "nsmallest"} & set(calls)


def test_a_pending_order_leaves_no_object_per_segment_for_the_garbage_collector() -> None:
    n = 20_000
    model = one_page_segments(n)
    gc.collect()
    tracked = len(gc.get_objects())
    order = eviction_order(model, before=math.inf)
    next(order)  # every segment valued, the heap built
    gc.collect()
    # A full collection traverses every object it tracks, holding the GIL: a list or a
    # _Segment per segment (as before) would double its work at a mass eviction.
    assert len(gc.get_objects()) - tracked < n // 20
    assert len(list(order)) == n - 1
