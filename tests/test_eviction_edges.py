"""Eviction on an operator's bad day: clocks that disagree, an index rebuilt under a writer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cachemgr.daemon.indexer import Indexer
from cachemgr.gc import chains
from cachemgr.gc.chains import ChainModel
from cachemgr.layout import Layout
from cachemgr.state.store import Store
from tests.daemon_helpers import NS_A, page_name, store_page
from tests.gc_helpers import NS, T0, Tree, evicted, page, policy
from tests.polling import wait_for
from tests.test_chains import Stream, preds


@pytest.fixture
def tree(root: Path) -> Iterator[Tree]:
    t = Tree.at(root)
    yield t
    t.store.close()


def test_min_age_zero_evicts_pages_last_used_in_the_future(tree: Tree) -> None:
    # The previous leader's clock ran 10 minutes ahead (or this host's clock stepped back):
    # its access times lie in the future. With no age rule they must still go, or the cap
    # cannot be held until the clock catches up.
    tree.write(NS, [page(i) for i in range(10)], at=T0 + 600)
    plan = tree.plan(policy(max_bytes=5000, high_watermark=1.0, low_watermark=0.5), now=T0)
    assert len(evicted(plan, "cap")) == 8  # down to the low watermark
    # An age rule keeps them: a future time is young (cachemgr.fs.deletecheck.too_young).
    aged = tree.plan(policy(max_bytes=5000, min_age=60.0), now=T0)
    assert evicted(aged, "cap") == []


def test_the_writers_pace_stays_a_pace_when_the_index_is_rebuilt(
    layout: Layout, store: Store
) -> None:
    # The DB file is deleted under a running index: it is rebuilt from disk. The bytes stored
    # so far start again from zero then, which must not read as a negative pace: GC would
    # count the cap as that much further away (`ahead`) and let the writer run over it.
    d = layout.ns_dir(NS_A)
    d.mkdir()
    ix = Indexer(layout, store, batch_interval=0.05)
    ix.start()
    try:
        assert ix.state.ready.wait(10)
        for i in range(50):  # over a few batches: the first one only starts the count
            store_page(d, page_name(i), 100_000)
            if i % 10 == 0:
                wait_for(lambda: ix.state.events_applied, lambda n, i=i: n > i, what="writes")
        wait_for(lambda: ix.state.write_rate, lambda r: r > 0, timeout=10, what="a pace")
        scans = ix.state.scans
        for f in layout.db_path.parent.glob(layout.db_path.name + "*"):
            f.unlink()
        wait_for(lambda: ix.state.scans, lambda n: n > scans, timeout=10, what="the rebuild")
        store_page(d, page_name(50), 100_000)  # a batch after the rebuild
        wait_for(lambda: ix.state.events_applied, lambda n: n > 50, timeout=10, what="it")
        assert ix.state.write_rate >= 0
    finally:
        ix.stop()


def test_a_deep_chain_is_learned_whole_at_the_cost_of_a_shallow_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A long context at a small page size makes chains thousands of pages deep. A new tail
    # page has no child, so linking it cannot close a cycle: no walk up its chain (which made
    # learning a chain quadratic: 94 s for 20,000 pages) and no depth limit.
    monkeypatch.setattr(chains, "CYCLE_WALK", 100)
    model = ChainModel()
    s = Stream(model)
    s.request([], list(range(1, 1001)))
    assert preds(model) == {1: None, **{p: p - 1 for p in range(2, 1001)}}
    s.read(1, 2)  # a shallow cycle is still refused
    s.read(1)
    assert preds(model)[1] is None
