"""bench/sim_policy.py: the eviction policy simulator gives sane answers on a tiny trace and
runs cachemgr's real eviction order."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from cachemgr.gc import order as gc_order
from cachemgr.gc.order import Candidate, order_stream


def _load() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "bench" / "sim_policy.py"
    spec = importlib.util.spec_from_file_location("sim_policy", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sim_policy"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


sim = _load()


@pytest.fixture(scope="module")
def trace():
    return sim.make_trace(40, 500, seed=3, sys_pages=8)


@pytest.fixture(scope="module")
def results(trace):
    return sim.run(trace)


def test_trace_is_reproducible(trace) -> None:
    again = sim.make_trace(40, 500, seed=3, sys_pages=8)
    assert again == trace
    assert sim.make_trace(40, 500, seed=4, sys_pages=8) != trace
    assert all(trace.parent[p] < p for p in range(trace.pages))  # ids grow along chains


def test_no_cap_hits_everything_written_before(trace, results) -> None:
    nocap = results[0]
    assert nocap.policy == "no cap" and nocap.cap is None
    assert nocap.hits == nocap.lookups - trace.pages  # every page misses once, then hits
    assert nocap.unusable_end == 0 and nocap.unusable_avg == 0


def test_capped_policies_are_bounded(trace, results) -> None:
    nocap = results[0].ratio
    capped = results[1:]
    assert {r.cap for r in capped} == {trace.pages // 3, trace.pages // 2}
    for r in capped:
        assert r.ratio <= nocap, r
        assert r.max_on_disk <= r.cap, r  # the cap is never exceeded
        assert r.evicted > 0, r
    by = {(r.policy, r.cap): r.ratio for r in capped}
    for cap in (trace.pages // 3, trace.pages // 2):
        best = by["clairvoyant", cap]
        assert best >= by["lru", cap]
        assert best >= by["lru-mtime", cap]
        assert by["lru", trace.pages // 3] <= by["lru", trace.pages // 2]


def test_unusable_counts_pages_behind_a_gap() -> None:
    parent = [-1, 0, 1, 2, 1]  # 0 -> 1 -> 2 -> 3, and 1 -> 4
    assert sim.unusable({0, 1, 2, 3, 4}, parent) == 0
    assert sim.unusable({0, 2, 3, 4}, parent) == 3  # 1 gone strands 2, 3 (through 2) and 4
    assert sim.unusable({1, 2}, parent) == 2


def test_the_real_order_is_called_and_depends_on_the_rate(trace, monkeypatch) -> None:
    calls: list[float] = []

    def counting(stream, *, gap, span):
        calls.append(gap)
        return order_stream(stream, gap=gap, span=span)

    monkeypatch.setattr(gc_order, "order_stream", counting)
    cap = trace.pages // 3
    slow, fast = sim.Cachemgr(0.1), sim.Cachemgr(100.0)
    r_slow, r_fast = sim.serve(trace, slow, cap), sim.serve(trace, fast, cap)
    assert calls and len(calls) >= 2
    assert slow.evicted and fast.evicted
    assert slow.evicted != fast.evicted  # one trace, two clocks, two orders: the weakness
    # At 0.1 req/s every request is its own burst: the order is request LRU, so it is at least
    # as good as page LRU here; at 100 req/s the whole trace is one burst and the newest,
    # least read pages go first.
    r_lru = sim.serve(trace, sim.Lru(), cap)
    assert r_slow.ratio >= r_lru.ratio > r_fast.ratio


def test_order_stream_is_the_policy_of_eviction_order() -> None:
    def c(t: float, seq: int, reads: int) -> Candidate:
        return Candidate(t, seq, "ns", (f"p{seq}",), 1, reads)

    # two requests of one chain, read head -> tail: 1, 2 then 1, 2, 3 (3 written)
    far = [c(0, 1, 1), c(0, 2, 1), c(100, 3, 2), c(100, 4, 2), c(100, 5, 0)]
    names = [x.names[0] for x in order_stream(far, gap=5, span=60)]
    assert names == ["p2", "p1", "p5", "p4", "p3"]  # older request first, tails first
    near = [x._replace(last_access=x.last_access / 1000) for x in far]
    names = [x.names[0] for x in order_stream(near, gap=5, span=60)]
    assert names == ["p5", "p2", "p1", "p4", "p3"]  # one burst: fewest reads, newest first
