"""The flat-dir entry limit (dir_full) and the DB-free floor pass (cachemgr.gc.floor).

The floor pass does not hold it, by design: a full dir index refuses new names in that one
dir while statvfs shows bytes and inodes free, so it never puts the root below the floor and
never keeps the state DB (another dir) from opening. The run that starts with a floor pass
goes on with the regular plan over the index, which holds dir_full in that same run."""

from __future__ import annotations

import os
from pathlib import Path

from cachemgr.fs.usage import DiskUsageFn
from cachemgr.gc.floor import below_floor, plan_floor
from cachemgr.gc.policy import GcPolicy
from cachemgr.gc.runner import GcRunner
from cachemgr.gc.step import GcReport
from tests.gc_helpers import NS, T0, Entries, Tree, page, policy

PAGES, SIZE = 100, 1000
TOTAL = 10_000_000


def _disk(tree: Tree) -> DiskUsageFn:
    """A filesystem 10 kB short of free until pages go (each page deleted frees its bytes)."""

    def usage(_root: Path) -> tuple[int, int, int]:
        held = sum(e.stat().st_size for e in os.scandir(tree.layout.ns_dir(NS)))
        free = 10_000 + PAGES * SIZE - held
        return TOTAL, TOTAL - free, free

    return usage


def test_a_run_that_starts_with_a_floor_pass_holds_the_dir_limit_too(tmp_path: Path) -> None:
    tree = Tree.at(tmp_path / "root")
    try:
        tree.write(NS, [page(i) for i in range(PAGES)], at=T0, size=SIZE)
        pol = policy(min_free_bytes=20_000, dir_entries=Entries(60))  # the dir's cap: 48 entries
        disk = _disk(tree)
        assert below_floor(tree.layout, pol, disk)
        floor_steps, _ = plan_floor(tree.layout, pol, now=T0 + 3600, disk_usage=disk)
        assert {s.reason for s in floor_steps} == {"free_space"}  # the pass frees bytes only
        report = _run(tree, pol)
        assert report.totals().keys() == {"free_space", "dir_full"}, report.totals()
        assert len(tree.files(NS)) == int(60 * 0.8 * 0.85)  # dir_full's low watermark, exactly
        assert not below_floor(tree.layout, pol, disk)
    finally:
        tree.store.close()


def test_the_plan_after_a_floor_pass_does_not_count_its_pages_again(tmp_path: Path) -> None:
    """A byte cap crossed with the floor: the floor pass deleted 24 pages, and the plan
    after it (same run) counted them still there and evicted 41 more for the cap, not 17."""
    tree = Tree.at(tmp_path / "root")
    try:
        tree.write(NS, [page(i) for i in range(PAGES)], at=T0, size=SIZE)
        pol = policy(min_free_bytes=20_000, max_bytes=70_000)
        report = _run(tree, pol)
        assert report.totals().keys() == {"free_space", "cap"}, report.totals()
        left = len(tree.files(NS))
        assert left == 70_000 * 0.85 // SIZE, report.totals()  # the cap's low watermark
        indexed = tree.store.conn.execute("SELECT COUNT(*) FROM pages").fetchone()[0]
        assert indexed == left  # the floor's pages left the index with its audit row
    finally:
        tree.store.close()


def _run(tree: Tree, pol: GcPolicy) -> GcReport:
    runner = GcRunner(tree.layout, tree.store, pol, disk_usage=_disk(tree), clock=lambda: T0 + 3600)
    try:
        return runner.run(sweep=True)
    finally:
        runner.leadership.release()
