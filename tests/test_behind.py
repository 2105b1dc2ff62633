"""Paced mass work behind the limits (cachemgr.gc.behind): a drain that gives way to every
wake still goes at its rate, a pacer kept across runs banks no idle time, a drop never stops
midway (its files were audited as it renamed them), and a floor pass drains trash only until
the floor is met."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachemgr.fs.deletion import Pacer
from cachemgr.gc.behind import Behind
from cachemgr.gc.execute import execute_gc
from cachemgr.gc.floor import floor_pass
from cachemgr.gc.runner import GcRunner, LiveState
from cachemgr.ns.runcontext import RunContext
from tests.gc_helpers import NS, NS2, T0, Tree, big_disk, page, policy


@pytest.fixture
def tree(root: Path) -> Iterator[Tree]:
    t = Tree.at(root)
    yield t
    t.close()


class WokenAtEachPlan(LiveState):
    """A writer that crosses a watermark while every run plans."""

    def in_flight(self):  # type: ignore[no-untyped-def]
        self.woken.set()
        return super().in_flight()


def test_a_drain_woken_at_every_run_goes_on_at_its_rate(tree: Tree) -> None:
    """It yielded before its first batch whenever GC had been woken since the loop cleared
    the wake: a writer at a cap starved a purge's drain, and each run that freed nothing was
    taken for stuck (5 s without a run)."""
    entry = tree.layout.trash / f"{NS2}.purged"
    entry.mkdir()
    for i in range(2000):
        (entry / page(i)).write_bytes(b"t")
    live = WokenAtEachPlan()
    gc = GcRunner(
        tree.layout, tree.store, policy(delete_rate=2000.0), disk_usage=big_disk, live=live
    )
    left = [2000]
    try:
        for _ in range(4):
            live.woken.clear()  # as the loop does before each tick
            time.sleep(0.2)  # 400 files' worth at the rate: one batch is due
            assert not gc._cycle(gc.tick)  # not stuck
            left.append(len(os.listdir(entry)))
    finally:
        gc.leadership.release()
    assert [a - b for a, b in itertools.pairwise(left)] == [Pacer.batch] * 4


def test_a_pacer_kept_across_runs_lets_one_batch_go_for_the_time_between() -> None:
    now = [0.0]
    pacer = Pacer(rate=100, sleep=lambda s: None, clock=lambda: now[0])
    for _ in range(256):
        pacer.tick()
    now[0] += 60.0  # planning, holding a cap, a pause: the next run's mass work starts
    assert pacer.due() == pytest.approx(2.56 - 60.0)
    pacer.owe_at_most(pacer.batch)
    assert pacer.due() == pytest.approx(
        -2.56
    )  # one batch at once, then the pace (5,888 went at once)


def test_a_drop_does_not_give_way_midway(tree: Tree) -> None:
    """A drop audits every file as it renames the dir away: stopping midway left the rest to
    a trash drain that audited it again (600 files audited as 944)."""
    tree.add_namespace(NS, active=T0, bound=True)
    tree.add_namespace(NS2, active=T0)
    tree.write(NS2, [page(i) for i in range(600)], at=T0)
    plan = tree.plan(policy(keep_unbound=0), now=T0 + 100)
    calls = iter(range(10**6))
    woken = Behind(Pacer(rate=1e9), lambda: next(calls) >= 3, lambda: None)  # in its 2nd part
    run: RunContext = tree.run(clock=lambda: T0 + 100, actor="auto")
    report = execute_gc(plan, run, after_limits=woken)
    assert [(r.reason, r.files, r.skipped) for r in report.steps] == [("unbound", 600, None)]
    assert os.listdir(tree.layout.trash) == []
    rows = tree.store.conn.execute("SELECT action, reason, pages FROM audit").fetchall()
    assert [tuple(r) for r in rows] == [("evict", "unbound", 600)]


def test_a_tiny_filesystem_s_wal_room_is_a_sixteenth_of_it(tmp_path: Path) -> None:
    from cachemgr.fs import reserve

    assert reserve.wal_room(16 << 20) == 1 << 20  # (4 MiB took all a small disk's free space)
    assert reserve.wal_room(1 << 40) == reserve.WAL_BYTES


def test_a_floor_pass_drains_trash_only_until_the_floor_is_met(tree: Tree) -> None:
    """It drained every trash entry whole, at delete_rate, before anything else ran: 75
    minutes for a 9M-file purge on a full disk, no cap kept meanwhile."""
    entry = tree.layout.trash / f"{NS2}.purged"
    entry.mkdir()
    for i in range(1000):
        (entry / page(i)).write_bytes(b"t" * 1000)

    def disk(_: Path) -> tuple[int, int, int]:  # 10 kB free, and what the pass frees
        free = 10_000 + 1000 * (1000 - len(os.listdir(entry)))
        return 10**9, 10**9 - free, free

    pol = policy(min_free_bytes=50_000)
    report = floor_pass(tree.layout, pol, disk_usage=disk, pacer=Pacer(rate=1e9, batch=16))
    assert report is not None
    assert [(r.reason, r.files) for r in report.steps] == [("trash", 48)]  # 3 parts of 16
    assert len(os.listdir(entry)) == 952 and disk(tree.layout.root)[2] >= 50_000
