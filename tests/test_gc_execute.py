"""Carrying out a GC plan when the kernel refuses an unlink: what went is still recorded."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachemgr.gc.execute import CHUNK, execute_gc
from cachemgr.gc.plan import GcPlan
from cachemgr.gc.step import GcReport
from cachemgr.state import store as store_module
from tests.gc_helpers import NS, T0, Tree, page, policy
from tests.locks import ForeignLock, held_here


@pytest.fixture
def tree(root: Path) -> Iterator[Tree]:
    t = Tree.at(root)
    yield t
    t.close()


def test_a_refused_unlink_is_kept_loudly_with_index_and_audit_exact(tree: Tree) -> None:
    """An immutable page (EPERM even for root) mid-chunk: it stays, the rest go; the run says
    so (a warning, a `permission` refusal, not held), and every page deleted has left the
    index and is audited."""
    names = [page(i) for i in range(3 * CHUNK)]
    tree.write(NS, names, at=T0, size=10)
    plan = tree.plan(policy(max_bytes=1), now=T0 + 1)
    (step,) = plan.steps
    stuck = tree.layout.ns_dir(NS) / step.names[CHUNK + CHUNK // 2]
    subprocess.run(["chattr", "+i", str(stuck)], check=True)
    try:
        report = execute_gc(plan, tree.run(clock=lambda: T0 + 1))
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
    on_disk = tree.files(NS)
    assert on_disk == {stuck.name}
    assert not report.held and report.refused_files() == {"permission": 1}
    (warning,) = report.warnings
    assert warning.startswith(f"1 files in ns/{NS} cannot be deleted by uid 0 (1 permission)")
    assert "chattr -i -a" in warning and "umask" not in warning  # EPERM: not the group's write
    indexed = {n for (n,) in tree.store.conn.execute("SELECT name FROM pages")}
    assert indexed == on_disk
    audited = tree.store.conn.execute("SELECT SUM(pages), SUM(bytes) FROM audit")
    assert tuple(audited.fetchone()) == (
        len(names) - len(on_disk),
        10 * (len(names) - len(on_disk)),
    )


def test_a_run_deletes_nothing_while_another_connection_holds_the_write_lock(tree: Tree) -> None:
    """A foreign write lock held past the store's patience: the run unlinks no file it could
    not record (it used to delete a chunk, then wait for the lock to record it), and its
    report names the lock's holder."""
    names = [page(i) for i in range(CHUNK + 10)]
    tree.write(NS, names, at=T0, size=10)
    report = under_a_foreign_lock(tree, tree.plan(policy(max_bytes=1), now=T0 + 1))
    assert tree.files(NS) == set(names)
    (warning,) = report.warnings
    assert warning.startswith(
        f"stopped deleting: the state DB was write-locked by {report.locked_by}"
    )


def test_this_process_s_own_long_writer_is_waited_out_not_taken_for_a_foreign_lock(
    tree: Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's own index thread may hold the write lock past a write's patience (a
    reconcile dropping millions of rows): GC failed its run as locked by "this process", a
    503 and an error counted for work that ends by itself. It now waits, and deletes all."""
    names = [page(i) for i in range(CHUNK + 10)]
    tree.write(NS, names, at=T0, size=10)
    plan = tree.plan(policy(max_bytes=1), now=T0 + 1)
    tree.store.patience = 0.2
    monkeypatch.setattr(store_module, "LOCK_POLL", 0.05)  # a BEGIN's own wait
    told: list[str] = []
    with held_here(tree.layout.db_path, 1.0):  # past the patience, a few times
        report = execute_gc(plan, tree.run(clock=lambda: T0 + 1, locked=told.append))
    assert told == [] and report.locked_by is None and report.files == len(names)
    assert tree.files(NS) == set()


def test_a_record_waits_out_this_process_s_own_writer_without_telling_locked(
    tree: Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for a record of files already deleted: told `locked`, a run stopped and
    failed (a 503) for a writer of this very process."""
    tree.store.patience = 0.2
    monkeypatch.setattr(store_module, "LOCK_POLL", 0.05)
    told: list[str] = []

    def write(patience: float | None) -> None:
        with tree.store.transaction(patience=patience) as conn:
            conn.execute("INSERT INTO notices (key, at) VALUES ('recorded', 0)")

    with held_here(tree.layout.db_path, 1.0):
        tree.run(locked=told.append).record_deleted(write)
    assert told == []
    assert [tuple(r) for r in tree.store.conn.execute("SELECT key FROM notices")] == [("recorded",)]


def test_a_trash_entry_is_not_drained_while_another_connection_holds_the_write_lock(
    tree: Tree,
) -> None:
    """The same for a purged namespace's entry in .trash/: its drain records once it is done,
    and deleted the whole entry first."""
    entry = tree.layout.trash / f"{NS}.purged"
    entry.mkdir()
    for i in range(5):
        (entry / page(i)).write_bytes(b"t" * 700)
    plan = tree.plan(policy(), now=T0 + 1)
    assert [s.reason for s in plan.steps] == ["trash"]
    under_a_foreign_lock(tree, plan)
    assert len(os.listdir(entry)) == 5


def under_a_foreign_lock(tree: Tree, plan: GcPlan) -> GcReport:
    """`plan` executed while another connection holds the state DB's write lock: nothing
    deleted is audited, and the report names the holder, as `locked` was told."""
    tree.store.patience = 0.2
    told: list[str] = []
    with ForeignLock(tree.layout.db_path) as foreign:
        foreign.take()
        report = execute_gc(plan, tree.run(clock=lambda: T0 + 1, locked=told.append))
    assert report.files == 0 and report.locked_by is not None and told == [report.locked_by]
    assert tree.store.conn.execute("SELECT COUNT(*) FROM audit").fetchone()[0] == 0
    return report


def touched_since_indexed(tmp_path: Path, n: int) -> tuple[Tree, float]:
    """`n` pages of NS the index knew written at T0 whose files were modified a minute before
    the time returned (two hours later)."""
    tree = Tree.at(tmp_path / "root")
    names = [page(i) for i in range(n)]
    tree.write(NS, names, at=T0)
    now = T0 + 7200
    for name in names:
        os.utime(tree.dir(NS) / name, (now - 60, now - 60))
    return tree, now


def test_a_limits_pages_found_young_at_deletion_yield_to_it(tmp_path: Path) -> None:
    """The index knew these pages written at T0, but their files were modified since (a
    restore's touch, a store while no daemon watched): the age rule kept every one at
    deletion, and the run said the cap held while it deleted nothing, run after run. min_age
    never stops a limit: they go as far as it needs, counted and said as a protection
    overridden, and the dry run says the same."""
    tree, now = touched_since_indexed(tmp_path, 300)
    pol = policy(namespace_max_files=100, min_age=3600.0)
    dry = tree.execute(tree.plan(pol, now=now), now=now, dry_run=True)
    report = tree.execute(tree.plan(pol, now=now), now=now)
    assert report.held and report.overridden == 215
    assert len(tree.files(NS)) == 85
    assert [s.young for s in report.steps] == [0]
    assert any("found modified within min_age" in w for w in report.warnings)
    assert [(s.files, s.young, s.overridden) for s in dry.steps] == [
        (s.files, s.young, s.overridden) for s in report.steps
    ]
    # What the limit does not need of them stays (the room it leaves): none taken past it.
    kept = tree.execute(tree.plan(pol, now=now), now=now)
    assert kept.steps == () and len(tree.files(NS)) == 85


def test_a_take_back_stopped_midway_still_counts_what_it_left_young(tmp_path: Path) -> None:
    """Stopped (a shutdown, the lease lost) inside the take-back of young pages: those it did
    not get to are still kept young, not counted as taken."""
    tree, now = touched_since_indexed(tmp_path, 700)
    plan = tree.plan(policy(namespace_max_files=100, min_age=3600.0), now=now)
    taking = lambda: len(os.listdir(tree.dir(NS))) < 700  # noqa: E731 (its first chunk went)
    run = tree.run(clock=lambda: now, stop=taking)
    (step,) = execute_gc(plan, run).steps
    assert 0 < step.files < len(step.step.names)
    assert step.young == len(step.step.names) - step.files and step.skipped is not None
    assert len(tree.files(NS)) == 700 - step.files
