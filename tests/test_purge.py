"""Purge as a library: plan, rename into .trash/, recreate if bound, drain, audit."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import pytest

from cachemgr.errors import ConfigError, NotFoundError, UnsafePathError
from cachemgr.fs.deletion import DeleteReport
from cachemgr.layout import Layout
from cachemgr.ns import purge_plan
from cachemgr.ns.manifest import read_manifest
from cachemgr.ns.purge import (
    describe_trash,
    drain_trash,
    execute_purge,
    list_trash,
    plan_purge,
    purge,
)
from cachemgr.ns.registry import bind, binding_of, list_namespaces
from cachemgr.settings import load_settings
from cachemgr.state import pages_sql
from cachemgr.state.index import scan_root
from cachemgr.state.store import Store
from tests.daemon_helpers import running_daemon
from tests.nsfixtures import PAGE_BYTES, make_ns, page_name, snapshot
from tests.polling import wait_for
from tests.vllmtrees import vllm_tree, write_blocks


def audit_rows(store: Store) -> list[tuple[str, str, str, str, int, int]]:
    rows = store.conn.execute(
        "SELECT action, namespace_id, reason, actor, pages, bytes FROM audit ORDER BY id"
    )
    return [tuple(r) for r in rows]  # type: ignore[misc]


def test_unbound_purge_renames_first_then_drains(layout: Layout, store: Store) -> None:
    ns = make_ns(layout, store, "a", pages=5)
    plan = plan_purge(layout, store, namespace=ns)
    assert (plan.pages, plan.bytes) == (5, 5 * PAGE_BYTES)
    result = execute_purge(plan, layout, store, actor="cli", reason="manual")
    # Renamed, not deleted: every page is in .trash/, the namespace and its manifest are gone.
    (entry,) = list_trash(layout)
    assert entry.startswith(ns + ".")
    assert sorted(os.listdir(layout.trash / entry)) == sorted(page_name(i, "a") for i in range(5))
    assert not layout.ns_dir(ns).exists() and not layout.manifest(ns).exists()
    assert result.purged[0].trash_name == entry and result.purged[0].manifest_removed
    state = store.conn.execute("SELECT state FROM namespaces WHERE id = ?", (ns,)).fetchone()[0]
    assert state == "purged"
    report = drain_trash(layout, store, actor="cli")
    assert (report.files, report.bytes, report.refused) == (5, 5 * PAGE_BYTES, ())
    assert os.listdir(layout.trash) == []
    assert audit_rows(store) == [
        ("purge", ns, "manual", "cli", 5, 5 * PAGE_BYTES),
        ("delete-trash", ns, "trash", "cli", 5, 5 * PAGE_BYTES),
    ]


def test_bound_namespace_is_recreated_empty_and_keeps_manifest(
    layout: Layout, store: Store
) -> None:
    ns = make_ns(layout, store, "a", pages=4, instance="srv1")
    _, result = purge(layout, store, actor="http", reason="mismatch", instance="srv1")
    assert layout.ns_dir(ns).is_dir() and os.listdir(layout.ns_dir(ns)) == []
    assert read_manifest(layout, ns) is not None
    assert binding_of(store, "srv1") == ns
    assert result.purged[0].recreated and not result.purged[0].manifest_removed
    (entry,) = list_trash(layout)
    assert len(os.listdir(layout.trash / entry)) == 4


def test_purging_one_never_touches_another(layout: Layout, store: Store) -> None:
    a = make_ns(layout, store, "a", pages=3, instance="one")
    b = make_ns(layout, store, "b", pages=3, instance="two")
    before = snapshot(layout.ns_dir(b))
    purge(layout, store, actor="cli", reason="manual", namespace=a)
    drain_trash(layout, store)
    assert snapshot(layout.ns_dir(b)) == before
    assert read_manifest(layout, b) is not None
    assert {n.ns_id: n.pages for n in list_namespaces(layout, store)} == {a: 0, b: 3}


def test_selectors(layout: Layout, store: Store) -> None:
    a = make_ns(layout, store, "a", instance="one")
    b = make_ns(layout, store, "b")
    assert [t.ns_id for t in plan_purge(layout, store, unbound=True).targets] == [b]
    assert {t.ns_id for t in plan_purge(layout, store, all=True).targets} == {a, b}
    assert [t.ns_id for t in plan_purge(layout, store, instance="one").targets] == [a]
    with pytest.raises(ConfigError, match="exactly one"):
        plan_purge(layout, store, all=True, unbound=True)
    with pytest.raises(ConfigError, match="exactly one"):
        plan_purge(layout, store)
    with pytest.raises(NotFoundError):
        plan_purge(layout, store, namespace="0" * 16)
    with pytest.raises(NotFoundError):
        plan_purge(layout, store, instance="nobody")


def test_unbound_plan_skips_a_namespace_bound_since(layout: Layout, store: Store) -> None:
    b = make_ns(layout, store, "b", pages=2)
    plan = plan_purge(layout, store, unbound=True)
    with store.transaction():
        bind(layout, store, "late", b, 0.0)
    assert execute_purge(plan, layout, store, actor="auto", reason="unbound").purged == ()
    assert len(os.listdir(layout.ns_dir(b))) == 2


@pytest.mark.parametrize("bad", ["../../etc", "ab/cd", "0123456789abcde/", "..", "x" * 16])
def test_hostile_namespace_ids_are_refused(layout: Layout, store: Store, bad: str) -> None:
    with pytest.raises(UnsafePathError, match="not a namespace id"):
        plan_purge(layout, store, namespace=bad)


def test_symlinked_namespace_dir_is_refused_untouched(
    layout: Layout, store: Store, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / page_name(1)).write_bytes(b"precious")
    (layout.ns_root / ("f" * 16)).symlink_to(victim)
    healthy = make_ns(layout, store, "a", pages=2)
    plan = plan_purge(layout, store, all=True)  # skipped and reported; the rest is planned
    assert [t.ns_id for t in plan.targets] == [healthy]
    assert len(plan.problems) == 1 and "symlink" in plan.problems[0]
    execute_purge(plan, layout, store, actor="cli", reason="manual")
    with pytest.raises(UnsafePathError, match="symlink"):  # named explicitly: refused
        plan_purge(layout, store, namespace="f" * 16)
    assert (victim / page_name(1)).read_bytes() == b"precious"
    assert (layout.ns_root / ("f" * 16)).is_symlink()


def test_symlink_inside_namespace_is_never_followed(
    layout: Layout, store: Store, tmp_path: Path
) -> None:
    ns = make_ns(layout, store, "a", pages=2)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"precious")
    (layout.ns_dir(ns) / page_name(99)).symlink_to(outside)
    purge(layout, store, actor="cli", reason="manual", namespace=ns)
    report = drain_trash(layout, store)
    assert report.files == 2 and len(report.refused) == 1
    assert "not a regular file" in report.refused[0]
    assert outside.read_bytes() == b"precious"
    (entry,) = describe_trash(layout)  # kept, with the symlink, for a person to look at
    assert entry.pages == 0


def test_symlink_planted_in_trash_is_refused(layout: Layout, store: Store, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / page_name(1)).write_bytes(b"precious")
    (layout.trash / f"{'e' * 16}.abc").symlink_to(victim)
    report = drain_trash(layout, store)
    assert report.files == 0 and "symlink" in report.refused[0]
    assert (victim / page_name(1)).read_bytes() == b"precious"
    assert describe_trash(layout)[0].problem is not None


def test_foreign_names_in_trash_are_left_alone(layout: Layout, store: Store) -> None:
    (layout.trash / "notes").mkdir()
    (layout.trash / "notes" / page_name(1)).write_bytes(b"x")
    assert drain_trash(layout, store) == DeleteReport()
    assert (layout.trash / "notes" / page_name(1)).exists()


def test_dry_run_drain_deletes_nothing(layout: Layout, store: Store) -> None:
    ns = make_ns(layout, store, "a", pages=3)
    purge(layout, store, actor="cli", reason="manual", namespace=ns)
    report = drain_trash(layout, store, dry_run=True)
    assert (report.files, report.dry_run) == (3, True)
    assert len(list_trash(layout)) == 1


def test_progress_reports_totals(layout: Layout, store: Store) -> None:
    ns = make_ns(layout, store, "a", pages=2100)
    purge(layout, store, actor="cli", reason="manual", namespace=ns)
    seen = []
    drain_trash(layout, store, progress=seen.append)
    assert seen[-1].files == 2100 and seen[-1].total_files == 2100
    assert [p.files for p in seen] == sorted(p.files for p in seen)


def test_uncounted_purge_still_audits_what_was_deleted(layout: Layout, store: Store) -> None:
    ns = make_ns(layout, store, "a", pages=4)
    plan, _ = purge(layout, store, actor="http", reason="manual", namespace=ns, count=False)
    assert (plan.pages, plan.targets[0].has_dir) == (0, True)
    drain_trash(layout, store, actor="http")
    assert audit_rows(store) == [
        ("purge", ns, "manual", "http", 0, 0),
        ("delete-trash", ns, "trash", "http", 4, 4 * PAGE_BYTES),
    ]


def _triggers(store: Store) -> list[tuple[str, str]]:
    rows = store.conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'")
    return sorted((r[0], r[1]) for r in rows)


def _stats(store: Store, ns: str) -> tuple[int, ...]:
    row = store.conn.execute(
        "SELECT pages, files, bytes, digest, page_reads FROM namespace_stats"
        " WHERE namespace_id = ?",
        (ns,),
    ).fetchone()
    return tuple(row)


@pytest.mark.parametrize("alone", [True, False], ids=["alone-truncated", "beside-another"])
def test_a_purged_namespace_leaves_no_index_row_and_every_trigger_works_after(
    layout: Layout, store: Store, monkeypatch: pytest.MonkeyPatch, alone: bool
) -> None:
    """Alone in the index (from TRUNCATE_ROWS rows) its rows go with the triggers dropped and
    made again; beside another, row by row with the stats row set aside. Either way the
    other namespace, the lifetime counters and the triggers are as they were."""
    monkeypatch.setattr(pages_sql, "TRUNCATE_ROWS", 3)
    a = make_ns(layout, store, "a", pages=5, instance="one")
    b = make_ns(layout, store, "b", pages=0 if alone else 2)
    scan_root(layout, store)
    with store.transaction():
        pages_sql.add_lifetime(store.conn, a, 7, 5, time.time())
    triggers, other = _triggers(store), _stats(store, b)
    purge(layout, store, actor="cli", reason="manual", namespace=a)
    assert _triggers(store) == triggers
    assert _stats(store, a) == (0, 0, 0, 0, 7) and _stats(store, b) == other
    count = store.conn.execute("SELECT namespace_id, count(*) FROM pages GROUP BY 1").fetchall()
    assert [tuple(r) for r in count] == ([] if alone else [(b, 2)])
    (layout.ns_dir(a) / page_name(9, "a")).write_bytes(b"x" * PAGE_BYTES)
    scan_root(layout, store)  # a store after the purge counts again: the triggers are back
    assert _stats(store, a)[:3] == (1, 1, PAGE_BYTES)


def test_a_purge_does_not_write_the_index_it_truncates_into_the_wal(
    layout: Layout, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows of a namespace alone in the index are freed, not overwritten: SQLite built
    with SECURE_DELETE (Debian's) zeroed every freed page through the -wal, so a 10M-page
    purge wrote 2.3 GB there (past the room kept for it) and held the write lock that long."""
    monkeypatch.setattr(pages_sql, "TRUNCATE_ROWS", 3)
    a = make_ns(layout, store, "a", pages=1, instance="one")
    scan_root(layout, store)
    with store.transaction():
        store.conn.execute(
            "WITH RECURSIVE k(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM k WHERE i < 20000)"
            " INSERT INTO pages (namespace_id, name, size, created_at, last_access, key_len)"
            " SELECT ?, printf('%064x_m_0_1.bin', i), 48, 1.0, 1.0, 64 FROM k",
            (a,),
        )
    store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    index_bytes = layout.db_path.stat().st_size
    wal = layout.db_path.with_name(layout.db_path.name + "-wal")
    assert index_bytes > 4 << 20 and wal.stat().st_size == 0
    purge(layout, store, actor="cli", reason="manual", namespace=a)
    assert _stats(store, a)[:3] == (0, 0, 0)
    assert wal.stat().st_size < index_bytes / 8


def test_a_plan_counts_from_the_live_index_not_the_disk(
    layout: Layout, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon indexes the root: a purge plan takes its counts (a scan of 10M pages took 127 s
    before the rename); with none, it scans."""
    a = make_ns(layout, store, "a", pages=6, instance="one")
    assert plan_purge(layout, store, namespace=a).pages == 6  # no daemon: scanned
    with running_daemon(load_settings(root=layout.root, gc_interval=3600)) as dm:
        wait_for(lambda: dm.namespaces()[a]["pages"], lambda n: n == 6)

        def no_scan(*_: object) -> None:
            raise AssertionError("scanned")

        monkeypatch.setattr(purge_plan, "scan_usage", no_scan)
        plan = plan_purge(layout, store, namespace=a)
        assert (plan.pages, plan.bytes) == (6, 6 * PAGE_BYTES)
    with pytest.raises(AssertionError, match="scanned"):  # the daemon is gone: no live index
        plan_purge(layout, store, namespace=a)


def test_a_bound_namespace_is_never_without_its_dir(
    layout: Layout, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dir is swapped with its empty successor in one step: a purge killed at any rename
    (here: stopped right after each) leaves the server a dir. Two renames left none between
    them, found with a kill -9 under strace."""
    ns = make_ns(layout, store, "a", pages=3, instance="srv")
    real_rename = os.rename

    def killed_after(*args: Any, **kw: Any) -> None:
        real_rename(*args, **kw)
        raise KeyboardInterrupt  # the process dies here, before its next step

    plan = plan_purge(layout, store, instance="srv")
    monkeypatch.setattr(os, "rename", killed_after)
    with contextlib.suppress(KeyboardInterrupt):
        execute_purge(plan, layout, store, actor="cli", reason="manual")
    monkeypatch.undo()
    assert layout.ns_dir(ns).is_dir() and os.listdir(layout.ns_dir(ns)) == []
    (entry,) = os.listdir(layout.trash)
    assert len(os.listdir(layout.trash / entry)) == 3


def test_two_purges_of_a_bound_vllm_namespace_audit_once(layout: Layout, store: Store) -> None:
    """The first purge recreates the dir with its identity file (vLLM writes it only at
    start); the second, planned before it, finds nothing more to move."""
    ns, ns_dir, folder = vllm_tree(layout, store)
    write_blocks(ns_dir, folder, 3)
    with store.transaction():
        bind(layout, store, "srv", ns, time.time())
    first, second = (plan_purge(layout, store, namespace=ns) for _ in range(2))
    assert len(execute_purge(first, layout, store, actor="cli", reason="manual").purged) == 1
    assert execute_purge(second, layout, store, actor="http", reason="manual").purged == ()
    assert [row[0] for row in audit_rows(store)] == ["purge"]
    assert len(os.listdir(layout.trash)) == 1
    assert [p.name for p in (ns_dir / folder).iterdir()] == ["config.json"]
