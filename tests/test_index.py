from __future__ import annotations

import logging
import os
from functools import reduce
from pathlib import Path

import pytest

from cachemgr.fs._dirscan import page_digest
from cachemgr.layout import Layout
from cachemgr.state.index import forget_namespace, scan_namespace, scan_root
from cachemgr.state.store import Store
from tests.daemon_helpers import NS_A, NS_B, page_name, store_page


def pages(store: Store, ns: str) -> dict[str, tuple[int, float, int]]:
    rows = store.conn.execute(
        "SELECT name, size, last_access, reads FROM pages WHERE namespace_id = ?", (ns,)
    )
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


def stats(store: Store, ns: str) -> tuple[int, int]:
    row = store.conn.execute(
        "SELECT pages, bytes FROM namespace_stats WHERE namespace_id = ?", (ns,)
    ).fetchone()
    return (row[0], row[1]) if row else (0, 0)


def digest(store: Store, ns: str) -> int:
    row = store.conn.execute("SELECT digest FROM namespace_stats WHERE namespace_id = ?", (ns,))
    return int(row.fetchone()[0])


def make_ns(layout: Layout, ns: str, n: int, size: int = 1000) -> Path:
    d = layout.ns_dir(ns)
    d.mkdir()
    for i in range(n):
        store_page(d, page_name(i), size)
    return d


def test_scan_indexes_every_page_with_its_size_and_mtime(layout: Layout) -> None:
    d = make_ns(layout, NS_A, 25)
    os.utime(d / page_name(3), (1000.0, 1000.0))
    store = Store.open(layout.db_path)
    report = scan_namespace(layout, store, NS_A)
    assert (report.pages, report.bytes, report.added, report.removed) == (25, 25_000, 25, 0)
    got = pages(store, NS_A)
    assert len(got) == 25 and {s for s, _, _ in got.values()} == {1000}
    assert got[page_name(3)][1] == 1000.0  # first seen by a scan: last access = mtime
    assert stats(store, NS_A) == (25, 25_000)


def test_rescan_keeps_recency_of_pages_that_stay_and_drops_gone_ones(layout: Layout) -> None:
    d = make_ns(layout, NS_A, 10)
    store = Store.open(layout.db_path)
    scan_namespace(layout, store, NS_A)
    store.conn.execute(
        "UPDATE pages SET last_access = 5e9, reads = 7 WHERE name = ?", (page_name(1),)
    )
    (d / page_name(2)).unlink()
    store_page(d, page_name(99), 500)
    report = scan_namespace(layout, store, NS_A)
    assert (report.added, report.removed, report.pages) == (1, 1, 10)
    got = pages(store, NS_A)
    assert got[page_name(1)][1:] == (5e9, 7)
    assert page_name(2) not in got and got[page_name(99)][0] == 500
    assert stats(store, NS_A) == (10, 9 * 1000 + 500)


def test_scan_counts_temp_foreign_and_odd_sized_pages(layout: Layout) -> None:
    d = make_ns(layout, NS_A, 6)
    (d / f".{'a' * 32}.tmp").write_bytes(b"half")
    (d / "notes.txt").write_text("hello")
    (d / "sub").mkdir()
    (d / page_name(50)).write_bytes(b"short")  # a truncated page
    os.symlink(d / page_name(0), d / page_name(51))
    store = Store.open(layout.db_path)
    report = scan_namespace(layout, store, NS_A)
    assert report.temp_files == 1
    assert report.foreign_files == 3  # notes.txt, sub/, the symlink
    assert report.corrupt_files == 1
    assert report.pages == 7 and page_name(51) not in pages(store, NS_A)


def test_scan_root_forgets_namespaces_whose_dir_is_gone(layout: Layout) -> None:
    make_ns(layout, NS_A, 3)
    d = make_ns(layout, NS_B, 4)
    store = Store.open(layout.db_path)
    assert sorted(r.namespace_id for r in scan_root(layout, store)) == [NS_A, NS_B]
    os.rename(d, layout.trash / NS_B)
    scan_root(layout, store)
    assert pages(store, NS_B) == {} and stats(store, NS_B) == (0, 0)
    assert stats(store, NS_A) == (3, 3000)


def test_aggregates_follow_any_writer_of_the_pages_table(layout: Layout) -> None:
    make_ns(layout, NS_A, 30)
    store = Store.open(layout.db_path)
    scan_namespace(layout, store, NS_A)
    # GC and purge delete rows on their own connections: the triggers keep the totals exact.
    other = Store.open(layout.db_path)
    with other.transaction() as conn:
        conn.execute("DELETE FROM pages WHERE name = ?", (page_name(0),))
        conn.execute("UPDATE pages SET size = 1 WHERE name = ?", (page_name(1),))
    assert stats(store, NS_A) == (29, 28 * 1000 + 1)
    # ... and the digest: the index now differs from the dir, and a scan puts both back.
    assert digest(store, NS_A) == reduce(
        lambda d, r: d ^ page_digest(r[0], r[1][0]), pages(store, NS_A).items(), 0
    )
    report = scan_namespace(layout, store, NS_A)
    assert (report.added, report.removed) == (1, 0) and stats(store, NS_A) == (30, 30_000)
    assert forget_namespace(store, NS_A) == 30
    assert stats(store, NS_A) == (0, 0) and digest(store, NS_A) == 0


def test_an_unchanged_dir_is_rescanned_without_reindexing(
    layout: Layout, caplog: pytest.LogCaptureFixture
) -> None:
    d = make_ns(layout, NS_A, 40)
    store = Store.open(layout.db_path)
    scan_namespace(layout, store, NS_A)
    caplog.set_level(logging.INFO, logger="cachemgr.state.index")
    report = scan_namespace(layout, store, NS_A)
    assert (report.pages, report.drift) == (40, 0)
    assert "reindexing namespace" not in caplog.text
    # Same count and bytes, another name (a rename while nobody watched): the digest tells.
    os.rename(d / page_name(5), d / page_name(500))
    report = scan_namespace(layout, store, NS_A)
    assert (report.added, report.removed) == (1, 1) and "reindexing namespace" in caplog.text
    assert page_name(500) in pages(store, NS_A) and page_name(5) not in pages(store, NS_A)
