"""Eviction on an operator's bad day: clocks that disagree, an index rebuilt under a writer."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachemgr.daemon.indexer import Indexer, IndexerConfig
from cachemgr.gc import chains
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.runner import GcRunner
from cachemgr.layout import Layout
from cachemgr.state.index import scan_namespace
from cachemgr.state.store import Store
from tests.daemon_helpers import NS_A, page_name, store_page
from tests.gc_helpers import NS, T0, Tree, big_disk, evicted, page, policy, temp
from tests.polling import wait_for
from tests.test_chains import Stream, preds


@pytest.fixture
def tree(root: Path) -> Iterator[Tree]:
    t = Tree.at(root)
    yield t
    t.close()


def test_min_age_zero_evicts_pages_last_used_in_the_future(tree: Tree) -> None:
    # The previous leader's clock ran 10 minutes ahead (or this host's clock stepped back):
    # its access times lie in the future. With no age rule they must still go, or the cap
    # cannot be held until the clock catches up.
    tree.write(NS, [page(i) for i in range(10)], at=T0 + 600)
    plan = tree.plan(policy(max_bytes=5000, high_watermark=1.0, low_watermark=0.5), now=T0)
    assert len(evicted(plan, "cap")) == 8  # down to the low watermark
    # With an age rule a future time is young (cachemgr.fs.deletecheck.too_young): they go
    # all the same, the cap wins over min_age, and the plan says so.
    aged = tree.plan(policy(max_bytes=5000, min_age=60.0), now=T0)
    assert len(evicted(aged, "cap")) == 6 and aged.overridden == 6


def test_the_writers_pace_stays_a_pace_when_the_index_is_rebuilt(
    layout: Layout, store: Store
) -> None:
    # The DB file is deleted under a running index: it is rebuilt from disk. The bytes stored
    # so far start again from zero then, which must not read as a negative pace: GC would
    # count the cap as that much further away (`ahead`) and let the writer run over it.
    d = layout.ns_dir(NS_A)
    d.mkdir()
    ix = Indexer(layout, store, IndexerConfig(batch_interval=0.05))
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


def test_sessions_without_a_shared_prefix_stay_separate_chains() -> None:
    # No system prompt shared: a chain's head is read (or written) first in its request, right
    # after another request's pages. That is no evidence of a link; linked, every session hung
    # under the previous one's tail and cold sessions went newest first (worse than LRU in
    # bench/sim_policy.py with sys_pages=0: -11% of the LRU->clairvoyant gap at W/3).
    model = ChainModel()
    s = Stream(model)
    chain = {"a": [1, 2, 3], "b": [10, 11, 12], "c": [20, 21, 22], "d": [30, 31, 32]}
    for x in "abcd":
        s.request([], chain[x])
    for x in "badcabdbab":  # no session follows the same one twice in a row
        s.request(chain[x], [])
    truth = {p: (c[i - 1] if i else None) for c in chain.values() for i, p in enumerate(c)}
    assert preds(model) == truth


def test_a_wrong_guess_is_repaired_on_every_rank_and_a_head_stays_unlinked() -> None:
    # TP 2: each rank's I/O thread reads every page of a request, so one request gives the same
    # evidence twice; only a second request may confirm it.
    model = ChainModel()
    s = Stream(model)
    ranks = ["_m_0_2.bin", "_m_1_2.bin"]

    def read(*pages: int) -> None:
        for p in pages:
            for r in ranks:
                s.read(p, suffix=r)

    for p in (60, 1, 2, 50, 3):  # 3's first guess is 50 (another session's page written between)
        for r in ranks:
            s.write(p, suffix=r)
    read(50)  # a request of 50's session, then one of 1-2-3
    read(1, 2, 3)
    assert preds(model)[3] is None  # doubted, not relinked yet
    read(60)  # another session's request
    read(1, 2, 3)
    assert preds(model)[3] == 2 and preds(model)[2] == 1 and preds(model)[1] is None


def test_a_dropped_link_is_dropped_in_the_index_too(tree: Tree) -> None:
    # Session B's first page was written right after session A's pages: its first guess
    # links it under A. Reads drop that link; a restart (the model built from the index) must
    # not bring it back.
    a, b = [page(i) for i in (1, 2)], [page(i) for i in (10, 11)]
    tree.write(NS, a, at=T0)
    tree.write(NS, b, at=T0 + 1)
    tree.read(NS, [page(50)], at=T0 + 2)  # (an unknown page: only moves the stream on)
    tree.read(NS, b, at=T0 + 3)
    row = tree.store.conn.execute(
        "SELECT pred FROM pages WHERE namespace_id = ? AND name = ?", (NS, b[0])
    ).fetchone()
    assert row[0] is None
    model = ChainModel.from_index(tree.store.conn, [NS])
    assert model.pages[(NS, b[0][:64])].pred is None
    assert model.pages[(NS, b[1][:64])].pred == b[0][:64]


def test_a_paced_run_does_not_count_as_the_time_gc_needs_to_keep_the_cap(tree: Tree) -> None:
    # The daemon counts what the writer adds while GC frees room as its pace times the last
    # run's duration (`ahead`). A paced run (stale temps, a dropped namespace, retention) may
    # take minutes: counted, the cap runs after it would evict that many minutes of writes.
    for i in range(40):
        path = tree.dir(NS) / temp(i)
        path.write_bytes(b"t")
        os.utime(path, (T0, T0))
    pol = policy(max_bytes=5000, delete_rate=200.0, tmp_ttl=60.0)
    runner = GcRunner(tree.layout, tree.store, pol, clock=lambda: T0 + 3600, disk_usage=big_disk)
    try:
        assert runner.run().totals() == {"tmp": (40, 40)}  # paced
        assert runner.run_seconds == 0.0  # no cap-keeping run yet
        tree.write(NS, [page(i) for i in range(10)], at=T0)
        assert runner.run(sweep=False).totals()["cap"][0] > 0
        assert runner.run_seconds > 0.0
    finally:
        runner.leadership.release()


def test_a_relearned_link_is_stored_for_every_file_of_the_page(tree: Tree) -> None:
    # TP 2: every page has a file per rank; both ranks read it, but only the first read of a
    # request changes the link. The index must hold the new link in every file's row, or a
    # restart brings back the old one from the row of the file that did not change it.
    def files(i: int) -> list[str]:
        return [page(i), page(i).replace("_0_1.bin", "_1_2.bin")]

    for i in (1, 2, 10, 11):  # 10's first guess is 2: it was written right after it
        tree.write(NS, files(i), at=T0 + i)
    tree.read(NS, files(50), at=T0 + 20)  # (another request: moves both streams on)
    tree.read(NS, [f for i in (10, 11) for f in files(i)], at=T0 + 21)
    live = tree.rec.model.pages[(NS, page(10)[:64])]
    assert live.pred is None
    model = ChainModel.from_index(tree.store.conn, [NS])
    assert model.pages[(NS, page(10)[:64])].pred is None


def test_an_index_rebuilt_from_disk_evicts_the_oldest_files_first(tree: Tree) -> None:
    # The DB was lost: a scan knows no access order and no chains, only each file's mtime.
    # The chain value ties for every page then; the files' times must still say what goes.
    d = tree.dir(NS)
    for i in range(10):
        (d / page(i)).write_bytes(b"\0" * 1000)
        at = T0 + (7 * i) % 10  # not in name order
        os.utime(d / page(i), (at, at))
    tree.add_namespace(NS, active=T0, bound=True)
    scan_namespace(tree.layout, tree.store, NS, now=lambda: T0 + 100)
    plan = tree.plan(policy(max_bytes=10_000, high_watermark=0.5, low_watermark=0.5), now=T0 + 100)
    by_age = sorted(range(10), key=lambda i: (7 * i) % 10)
    assert evicted(plan, "cap") == [page(i) for i in by_age[:5]]
