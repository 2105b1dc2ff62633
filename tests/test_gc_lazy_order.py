"""The eviction order is selected lazily: the same victims as one stable sort of every
segment by (value, last, when), ties included, but a caller that stops after k victims takes k
segments off a heap (or off C's sort of the segments of one page: cachemgr.gc._rank), never
sorts them all in Python, and leaves no object per segment for the cyclic garbage collector to
traverse (both hold the GIL: a /metrics scrape waits behind them)."""

from __future__ import annotations

import gc
import math
import random
import sys
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import islice
from types import FrameType

from cachemgr.gc.adapt import ORDERS
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.returns import prior, worth
from cachemgr.gc.value import _leaves, _path, _segments, _walked, eviction_order
from cachemgr.gc.value import _Ranked as Ranked

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


def reference(model: ChainModel, before: float, held: set[int], order: int) -> list[Ranked]:
    """Every segment walked and valued in Python, then sorted by (key, last, when, position):
    what the order gives, its one-page segments valued and sorted in C included."""
    st, clock = model.store, model.clock
    leaves = _leaves(st, None)
    raw = _walked(model, leaves, array("i", range(len(leaves))), {}, before, held, None)
    fit = prior((st.reads[top], max(clock - st.born[top], 0)) for _, _, _, top, _, _, _ in raw)
    trial_end = model.adapt.trial_end(clock, st.count)
    out = []
    for at, leaf, walked, top, last, when, stranded in raw:
        value = worth(fit, st.reads[top], max(last - st.born[top], 0), clock - last)
        trial = -0.5 if not st.reads[top] and last < trial_end else value
        key = -1.0 if stranded else (value, 0.0, trial)[order]
        out.append((key, last, when, at, leaf, walked))
    return sorted(out, key=lambda s: s[:4])


def test_the_lazy_selection_is_a_sort_of_every_segment_valued_in_python() -> None:
    rng = random.Random(13)
    ties = one_page = 0
    for _ in range(300):
        model = random_model(rng)
        st = model.store
        before = rng.choice([math.inf, 1.5])
        held = set(rng.sample(range(st.top), min(st.top, rng.choice([0, 3]))))
        for order in range(len(ORDERS)):  # (each order the model may follow)
            expected = reference(model, before, held, order)
            got = list(_segments(model, _leaves(st, None), {}, before, held, None, order))
            # (the same keys to the last bit: C computes each value as returns.worth does)
            assert [s[:5] for s in got] == [s[:5] for s in expected]
            assert [_path(st, *s[4:]) for s in got] == [_path(st, *s[4:]) for s in expected]
            one_page += sum(s[5] is None for s in got)
        ties += len(expected) - len({s[:3] for s in expected})
    assert ties > 1000  # the tie-break (the leaves' order) was exercised
    assert one_page > 10_000  # and the C path: segments of one page no chain links


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


def test_a_mass_evictions_first_victims_cost_no_python_call_a_segment() -> None:
    n, k = 20_000, 10
    model = one_page_segments(n)
    with c_calls() as calls:
        order = eviction_order(model, before=math.inf)
        first = [v.key for v in islice(order, k)]
        order.close()  # (the plan has enough)
    assert first == [key(i) for i in sorted(range(n), key=lambda i: i * 7919 % n)[:k]]
    # Valued and sorted in C (cachemgr.gc._rank), taken one at a time: a few calls a victim
    # (its key, names and the miniatures' scores), none a segment.
    assert sum(calls.values()) < 50 * k
    assert not {"heappush", "sort", "nsmallest"} & set(calls)  # (merge heapifies its 2 inputs)


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
