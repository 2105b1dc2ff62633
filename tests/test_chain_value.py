"""How the order values a chain (cachemgr.gc.value, cachemgr.gc.history): by its returns and
age (a Gamma-Poisson estimate pooled over all chains), its silence, and what is remembered of
it after its head was evicted, not by the recency of its last page alone."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from cachemgr import gil
from cachemgr.daemon.events import LOCAL, Kind
from cachemgr.daemon.page_events import PageEvents
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.history import History
from cachemgr.gc.returns import Moments, fitted, prior, worth
from cachemgr.gc.value import eviction_order
from cachemgr.state.index import scan_namespace
from cachemgr.state.store import Store
from tests.gc_helpers import NS, Tree, page
from tests.test_chains import KEY_LEN, SUFFIX, Stream, key, order


def evict(model: ChainModel, *pages: int) -> None:
    """What GC does: the files go, the model forgets them."""
    model.remove("ns", [(key(p) + SUFFIX, KEY_LEN) for p in pages])


def test_a_chain_written_and_never_read_goes_before_an_older_chain_read_many_times() -> None:
    model = ChainModel()
    s = Stream(model)
    s.request([], [1, 2])  # the system prompt
    for chain in range(100, 110):  # ten one-off chains: most chains are never read again
        s.request([1, 2], [chain])
    s.request([1, 2], [20])  # A: a conversation that keeps coming back
    for n in range(21, 32):
        s.request([1, 2, *range(20, n)], [n])
    s.request([1, 2], [40, 41, 42])  # B: written after A's last use, never read
    got = order(model)
    assert got.index(42) < got.index(31)  # page LRU would evict A's pages first
    assert [got.index(p) for p in (42, 41, 40)] == sorted(got.index(p) for p in (40, 41, 42))


def test_a_returning_evicted_chain_keeps_its_history() -> None:
    model = ChainModel()
    s = Stream(model)
    s.request([], [1, 2])
    for chain in range(100, 110):
        s.request([1, 2], [chain])
    s.request([1, 2], [20])  # A returns ten times
    for n in range(21, 31):
        s.request([1, 2, *range(20, n)], [n])
    evict(model, *range(30, 19, -1))  # GC took all of A, tail first
    s.request([1, 2], [20, 21, 22])  # A comes back: SGLang writes it again from its head
    s.request([1, 2], [50, 51, 52])  # C: a new chain, its last use more recent than A's
    got = order(model)
    assert got.index(52) < got.index(22)  # A is known to return; C is not
    assert model.pages["ns", key(20)].reads == 11  # its ten returns, and this one


def test_a_new_chain_the_history_does_not_know_is_valued_as_any_new_chain() -> None:
    model = ChainModel()
    s = Stream(model)
    s.request([], [1, 2])
    s.request([1, 2], [20])
    s.request([1, 2], [30])
    evict(model, 20)
    s.request([1, 2], [25])  # never on disk before: nothing to remember
    assert model.pages["ns", key(25)].reads == 0


def test_a_page_evicted_unread_and_written_again_comes_back_with_one_return() -> None:
    """Wanted twice (ARC's and S3-FIFO's ghost hit): no longer on trial."""
    model = ChainModel()
    s = Stream(model)
    s.request([], [1, 2])
    s.request([1, 2], [20])
    s.request([1, 2], [30])
    evict(model, 20)  # never read
    s.request([1, 2], [20])
    assert model.pages["ns", key(20)].reads == 1


def test_a_page_written_again_behind_a_gap_is_still_reaped_first() -> None:
    model = ChainModel()
    s = Stream(model)
    s.request([], [1, 2, 3])
    s.read(99)  # (other sessions' requests in between: 1 does not always follow 3)
    s.request([1, 2, 3], [])
    evict(model, 3)
    s.read(98)
    s.read(1, 2)  # a request reads the prefix, and GC deletes 2 right after
    evict(model, 2)
    s.write(3)  # the request writes 3 behind the gap: unusable
    assert model.pages["ns", key(3)].reads == 0
    assert order(model)[0] == 3


def test_the_history_is_bounded_oldest_first() -> None:
    model = ChainModel()
    model.history = History(size=2)
    s = Stream(model)
    s.request([], [1])
    s.request([1], [40])  # (a chain that stays: 1 remains a branch point)
    for chain in (10, 20, 30):
        s.request([1], [chain])
        s.request([1, chain], [])
    evict(model, 10, 20, 30)
    s.request([1], [10])  # forgotten: the two most recent evictions are remembered
    s.request([1], [30])
    assert model.pages["ns", key(10)].reads == 0
    assert model.pages["ns", key(30)].reads == 2  # its return, and this one


def test_silence_lowers_a_chains_value_and_returns_raise_it() -> None:
    fitted = prior([(0, 1000), (1, 1000), (5, 1000), (20, 1000)])
    shape, rate = fitted
    assert shape > 0 and math.isclose(shape / rate, 26 / 4000)  # the pooled rate
    assert worth(fitted, 5, 500, 0) > worth(fitted, 5, 500, 100) > worth(fitted, 5, 500, 5000)
    assert worth(fitted, 10, 500, 100) > worth(fitted, 2, 500, 100)
    assert worth(fitted, 0, 0, 10**12) >= 0.0  # no overflow, however long the silence


def test_the_prior_summed_a_slice_at_a_time_is_the_prior_of_all_segments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The prior's sums over 10M segments held the GIL for most of a second in one C call:
    they are summed a slice at a time (cachemgr.gil), and come to the same sums."""
    rng = random.Random(5)
    chains = [(rng.choice([0, 0, 1, 3, 40]), rng.randrange(1, 10**6)) for _ in range(1000)]
    c, e = sum(r for r, _ in chains), sum(x for _, x in chains)
    cc, ce = sum(r * r for r, _ in chains), sum(r * x for r, x in chains)
    whole = fitted(Moments(c, e, cc, ce, sum(x * x for _, x in chains)))
    monkeypatch.setattr(gil, "SLICE", 7)  # 143 slices, the last one short
    assert prior(iter(chains)) == whole != prior(chains[:-1])


def test_an_order_gives_the_gil_way_between_its_key_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each victim's key is a pread, which gives the GIL up and takes it back before a waiting
    thread wakes (an order of 200,000 vLLM blocks kept one waiting 62-165 ms): the order sleeps
    a moment once every gil.EVERY seconds, by its clock, not at every key."""
    now = [0.0]
    naps: list[float] = []
    monkeypatch.setattr(gil, "clock", lambda: now[0])
    monkeypatch.setattr(gil, "nap", naps.append)
    model = ChainModel()
    for i in range(10):
        model.add(NS, f"{i:064x}_m_0_1.bin", 64, 1, seq=i + 1, at=0.0)
    order = eviction_order(model, before=math.inf, now=math.inf)
    for _ in range(4):  # within EVERY of the start: no nap
        next(order)
    assert naps == []
    now[0] += gil.EVERY
    next(order)
    assert naps == [gil.PAUSE]
    assert len(list(order)) == 5 and naps == [gil.PAUSE]  # the clock stood still since


def test_a_chain_back_after_the_index_was_rebuilt_is_valued_without_error(tmp_path: Path) -> None:
    """The state DB deleted or moved aside as corrupt while the daemon runs: the index thread
    rebuilds it from disk and feeds the same model (cachemgr.daemon.indexer._build), whose
    history remembers chain heads by the access sequence of before. A remembered chain that
    comes back must neither take a birth after its last use (the order divided by zero or
    valued it below nothing) nor stop the order."""
    tree = Tree.at(tmp_path / "root")
    names = [page(0, model="head"), *(page(i) for i in range(1, 60))]  # 0: a stream of its own
    tree.write(NS, names[10:], at=1.0)  # the clock moves on: the head is born late
    tree.write(NS, names[:1], at=2.0)
    for t in range(3):
        tree.read(NS, names[:1], at=3.0 + t)
    model = tree.rec.model
    (tree.layout.ns_dir(NS) / names[0]).unlink()
    tree.rec.apply([(Kind.GONE, NS, names[0], 0.0, LOCAL)], now=7.0)  # remembered: read thrice
    tree.store.close()
    tree.layout.db_path.unlink()  # the DB lost: a fresh one, rebuilt from disk
    tree.store = Store.open(tree.layout.db_path)
    try:
        _after_rebuild(tree, model, names[0])
    finally:
        tree.store.close()


def _after_rebuild(tree: Tree, model: ChainModel, name: str) -> None:
    tree.rec = PageEvents(tree.layout, tree.store, model)
    scan_namespace(tree.layout, tree.store, NS, now=lambda: 8.0)
    model.load(tree.store.conn, NS)
    tree.write(NS, [name], at=9.0)  # the chain comes back
    head = model.pages[NS, f"{0:064x}"]
    assert head.reads == 4 and head.born <= head.last
    assert len(list(eviction_order(model, before=math.inf))) == 51


def test_an_index_row_born_after_its_last_use_does_not_stop_the_order(tmp_path: Path) -> None:
    """An index edited by hand or damaged short of corrupt: a page whose birth comes after
    its last access. The order counts no exposure for it rather than divide by zero."""
    tree = Tree.at(tmp_path / "root")
    try:
        tree.write(NS, [page(1, model="a")], at=1.0)
        tree.write(NS, [page(2, model="b")], at=2.0)
        with tree.store.transaction() as conn:
            conn.execute(
                "UPDATE pages SET born_seq = access_seq + 1 WHERE name = ?", (page(1, model="a"),)
            )
        model = ChainModel.from_index(tree.store.conn, [NS])
    finally:
        tree.store.close()
    assert [v.key for v in eviction_order(model, before=math.inf)] == [f"{1:064x}", f"{2:064x}"]
