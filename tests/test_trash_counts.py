"""A purge's record of what it moved into .trash/ (cachemgr.state.trash_sql): GC, status, ls
and doctor read it instead of walking the entry, and every drain counts it down as it goes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from cachemgr.gc import find
from cachemgr.ns import trash
from cachemgr.ns.purge import execute_purge, plan_purge, purge
from cachemgr.ns.purge_intent import SWAPPED, trash_counts
from cachemgr.ns.trash import describe_trash, drain_entry, left_for_people
from cachemgr.state import intents_sql, trash_sql
from cachemgr.state import store as store_module
from cachemgr.state.intents_sql import Intent
from tests.gc_helpers import NS, T0, Tree, page, policy
from tests.locks import ForeignLock


@pytest.fixture
def tree(root: Path) -> Iterator[Tree]:
    t = Tree.at(root)
    yield t
    t.close()


def purged(tree: Tree, pages: int) -> str:
    """`pages` pages of 100 bytes written to NS, indexed, then purged: the trash entry."""
    tree.write(NS, [page(i) for i in range(pages)], at=T0, size=100)
    _, result = purge(tree.layout, tree.store, actor="cli", reason="manual", namespace=NS)
    entry = result.purged[0].trash_name
    assert entry is not None
    return entry


def trash_steps(tree: Tree) -> list[tuple[int, int]]:
    """The files and bytes of each trash step GC plans now."""
    plan = tree.plan(policy(), now=T0 + 10)
    return [(s.files, s.bytes) for s in plan.steps if s.reason == "trash"]


def recorded(tree: Tree) -> dict[str, tuple[int, int]]:
    return trash_sql.recorded(tree.store.conn)


def test_a_purge_records_its_count_so_that_its_drain_starts_without_a_walk(tree: Tree) -> None:
    """GC counts a trash entry before it drains it, and a walk of 9M files kept a purge's drain
    from starting for minutes. The purge records what it moved; each drain counts it down; the
    drain that ends it forgets it, and what the entry still holds is scanned (and named)."""
    entry = purged(tree, 600)
    moved = tree.layout.trash / entry
    (moved / page(999)).write_bytes(b"x" * 100)  # a scan would count it: the record does not
    (moved / "notes.txt").write_text("mine")  # foreign: the drain leaves it
    assert trash_steps(tree) == [(600, 60_000)] == list(recorded(tree).values())
    (told,) = describe_trash(tree.layout, recorded(tree))  # status, ls, doctor
    assert (told.pages, told.bytes, told.foreign) == (600, 60_000, 0)
    drain_entry(tree.run(dry_run=True), entry)
    assert trash_steps(tree) == [(600, 60_000)]  # a dry run counts nothing down
    asked = iter([False, True])  # stopped after its first part, as a shutdown stops it
    part = drain_entry(tree.run(stop=lambda: next(asked)), entry)
    assert part.stopped and 0 < part.files < 601
    assert trash_steps(tree) == [(600 - part.files, 60_000 - part.bytes)]
    rest = drain_entry(tree.run(), entry)
    assert part.files + rest.files == 601 and sorted(os.listdir(moved)) == ["notes.txt"]
    assert recorded(tree) == {}
    plan = tree.plan(policy(), now=T0 + 10)  # scanned now: no page left, the foreign file said
    assert [(s.reason, s.files) for s in plan.steps] == [("trash", 0)]
    note = f".trash/{entry}: left for a person: 1 foreign file, e.g. {moved}/notes.txt"
    assert plan.warnings == (note,) and left_for_people(tree.layout, recorded(tree)) == [note]


def test_a_drain_counts_the_entry_down_as_it_goes_not_only_at_its_end(
    tree: Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drain killed hours into an entry (kill -9: nothing after it runs) must not leave the
    whole count behind: GC's free-space floor would count files long gone as still to be
    freed. An interrupt or an error takes off what went before it."""
    monkeypatch.setattr(trash, "COUNT_EVERY", 0.0)  # a tick at each progress report
    entry = purged(tree, 2_500)
    seen: list[tuple[int, int]] = []

    def interrupted(files: int, size: int) -> None:
        seen.append(recorded(tree)[entry])  # what a kill -9 here would leave
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        drain_entry(tree.run(), entry, progress=interrupted)
    assert seen == [(2_500, 250_000), (1_476, 147_600)]  # 1,024 taken at the first report
    assert recorded(tree)[entry] == (452, 45_200)  # 2,048 taken as it was interrupted
    assert len(os.listdir(tree.layout.trash / entry)) == 452


def test_the_count_recorded_is_the_live_index_s_as_the_dir_moves_not_the_plan_s(
    tree: Tree,
) -> None:
    """A bound namespace is written to while a person reads the purge's prompt: a count taken
    at the plan is low, and GC's floor would then evict live pages to make up for it."""
    tree.write(NS, [page(i) for i in range(100)], at=T0, size=100)
    plan = plan_purge(tree.layout, tree.store, namespace=NS)
    assert plan.pages == 100
    tree.write(NS, [page(i) for i in range(100, 300)], at=T0 + 1, size=100)  # meanwhile
    result = execute_purge(
        replace(plan, indexed=True), tree.layout, tree.store, actor="cli", reason="manual"
    )
    entry = result.purged[0].trash_name
    assert entry is not None and recorded(tree) == {entry: (300, 30_000)}


def test_an_entry_with_a_count_turned_symlink_is_refused_not_counted(
    tree: Tree, tmp_path: Path
) -> None:
    """Its count must not stand for a link: the entry is skipped with a warning, as one
    without a count is, and doctor's and status's report name the problem."""
    entry = purged(tree, 10)
    where = tree.layout.trash / entry
    elsewhere = tmp_path / "elsewhere"
    where.rename(elsewhere)
    where.symlink_to(elsewhere)
    plan = tree.plan(policy(), now=T0 + 10)
    assert [s for s in plan.steps if s.reason == "trash"] == []
    assert [w.split(":")[0] for w in plan.warnings] == [f".trash/{entry} skipped"]
    (told,) = describe_trash(tree.layout, recorded(tree))
    assert told.problem is not None and told.pages == 0
    assert len(os.listdir(elsewhere)) == 10  # nothing behind the link touched


def test_a_drain_whose_record_meets_a_foreign_lock_says_who_holds_it_then_records(
    tree: Tree,
) -> None:
    """A drain deleted its entry and then waited, with no word, for another process's write
    lock to record it: a `POST /v1/gc` waiting for the run hung for as long as the lock. Its
    record now tells `locked` who holds it once it has waited a write's patience, and lands
    once the lock goes."""
    entry = purged(tree, 300)
    tree.store.patience = 0.2
    with ForeignLock(tree.layout.db_path) as foreign:  # taken during the drain, let go once told
        part = drain_entry(tree.run(locked=foreign.told), entry, progress=foreign.take_once)
    assert len(foreign.named) == 1 and part.files == 300
    audited = tree.store.conn.execute(
        "SELECT pages FROM audit WHERE action = 'delete-trash'"
    ).fetchall()
    assert [tuple(r) for r in audited] == [(300,)] and recorded(tree) == {}


def test_a_drain_stops_at_a_foreign_lock_rather_than_delete_its_entry_unrecorded(
    tree: Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A foreign write lock taken midway (a person's `sqlite3` shell in a transaction) let a
    drain delete the rest of its entry, millions of files at a purge's size, none of them in
    the audit or the count until the lock went. Its count's tick now finds the lock, waits a
    write's patience, says who holds it and stops the drain at its next part; what went is
    recorded once the lock is free, the rest stays for the next drain."""
    monkeypatch.setattr(trash, "COUNT_EVERY", 0.0)  # a tick at each progress report
    monkeypatch.setattr(trash, "COUNT_PATIENCE", 0.05)
    monkeypatch.setattr(store_module, "LOCK_POLL", 0.05)  # a BEGIN's own wait
    entry = purged(tree, 2_500)
    tree.store.patience = 0.2
    with ForeignLock(tree.layout.db_path) as foreign:
        part = drain_entry(tree.run(locked=foreign.told), entry, progress=foreign.take_once)
    assert len(foreign.named) == 1 and part.stopped and part.files == 1_024  # the 1st report's
    assert len(os.listdir(tree.layout.trash / entry)) == 1_476
    assert recorded(tree) == {entry: (1_476, 147_600)}
    audited = tree.store.conn.execute(
        "SELECT pages FROM audit WHERE action = 'delete-trash'"
    ).fetchall()
    assert [tuple(r) for r in audited] == [(1_024,)]
    rest = drain_entry(tree.run(), entry)  # the next drain finishes it
    assert rest.files == 1_476 and recorded(tree) == {}


def test_a_purge_s_drain_stopped_by_a_lock_says_so_and_leaves_the_entries_after_it(
    tree: Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI's drain (`cachemgr purge`, `init` after a purge) must not end as if done: it
    says who holds the lock, its report says `stopped` (the purge exits 1 on it), and the
    entries after the one it stopped in wait for the lock too."""
    monkeypatch.setattr(trash, "COUNT_EVERY", 0.0)
    monkeypatch.setattr(trash, "COUNT_PATIENCE", 0.05)
    monkeypatch.setattr(store_module, "LOCK_POLL", 0.05)
    first = purged(tree, 2_500)
    second = purged(tree, 10)  # (entries are named by the time: drained after the first)
    tree.store.patience = 0.2
    with ForeignLock(tree.layout.db_path) as foreign:
        report = trash.drain_trash(
            tree.layout, tree.store, progress=foreign.take_once, locked=foreign.told
        )
    assert len(foreign.named) == 1 and report.stopped and report.files == 1_024
    assert recorded(tree) == {first: (1_476, 147_600), second: (10, 1_000)}
    assert sorted(os.listdir(tree.layout.trash)) == sorted([first, second])
    assert len(os.listdir(tree.layout.trash / second)) == 10


@pytest.mark.parametrize("bound", [False, True], ids=["moved", "swapped"])
def test_an_entry_renamed_by_a_purge_not_yet_committed_is_counted_by_its_intent_not_walked(
    tree: Tree, monkeypatch: pytest.MonkeyPatch, bound: bool
) -> None:
    """A purge commits its intent, renames the dir, then drops the namespace's rows and
    records the count (~1 s at 10M pages). GC's plan in that window found an entry with no
    count and walked it (9M files: its drain began 127 s after the purge). It takes the
    intent's count, as status, ls and doctor do; a bound namespace's dir is swapped with an
    empty one, and lies under the intent's name + "n"."""
    if bound:
        tree.add_namespace(NS, active=T0, bound=True)
    entry = purged(tree, 300)
    assert entry.endswith(SWAPPED) == bound
    st = os.stat(tree.layout.trash / entry)
    intent = Intent(entry.removesuffix(SWAPPED), NS, "manual", "cli", 290, 29_000, T0, 0, 0)
    with tree.store.transaction() as conn:  # as between the purge's rename and its commit
        trash_sql.forget(conn, entry)
        intents_sql.insert(conn, replace(intent, dev=st.st_dev, ino=st.st_ino))
    counted = trash_counts(tree.layout, tree.store.conn)
    assert counted == {entry: (290, 29_000)}

    def no_walk(*args: object) -> None:
        raise AssertionError("an entry with an intent was walked")

    monkeypatch.setattr(find, "scan_entry", no_walk)
    monkeypatch.setattr(trash, "scan_entry", no_walk)
    assert trash_steps(tree) == [(290, 29_000)]
    (told,) = describe_trash(tree.layout, counted)
    assert (told.pages, told.bytes) == (290, 29_000)


def test_an_intent_counts_only_for_its_own_dir(tree: Tree) -> None:
    """A purge killed after it made the empty dir and before the swap left that one under
    the entry's name + "n": not the dir its intent counted, so it is walked (empty), as a
    drain's settle_entry asks the same."""
    entry = purged(tree, 10)
    with tree.store.transaction() as conn:
        trash_sql.forget(conn, entry)
        intents_sql.insert(conn, Intent(entry, NS, "manual", "cli", 10, 1_000, T0, 1, 2))
    assert trash_counts(tree.layout, tree.store.conn) == {}
