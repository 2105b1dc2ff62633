"""A page is every file with its key (an extra pool's part, each TP rank's file): the index
counts it once, GC evicts it whole and orders it by its most recently used file."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from cachemgr.daemon.metrics import CachemgrCollector
from cachemgr.layout import Layout
from cachemgr.state.index import scan_namespace
from cachemgr.state.store import Store, bundled_migrations, connect, migrate
from tests.conftest import SglangDriver
from tests.daemon_helpers import register_namespace, store_page
from tests.gc_helpers import NS, T0, Tree, evicted, page, policy
from tests.nsfixtures import cli


def files_of(i: int) -> list[str]:
    """Page i as a hybrid model on TP 2 writes it: KV and mamba parts on ranks 0 and 1."""
    return [
        page(i),
        page(i, pool="mamba"),
        page(i).replace("_0_1.bin", "_1_2.bin"),
        page(i, pool="mamba").replace("_0_1.bin", "_1_2.bin"),
    ]


@pytest.fixture
def tree(root: Path) -> Iterator[Tree]:
    t = Tree.at(root)
    yield t
    t.close()


def stats(tree: Tree) -> tuple[int, int, int]:
    row = tree.store.conn.execute(
        "SELECT pages, files, bytes FROM namespace_stats WHERE namespace_id = ?", (NS,)
    ).fetchone()
    return tuple(row) if row else (0, 0, 0)


def test_the_index_counts_one_page_per_key_and_bytes_of_every_file(tree: Tree) -> None:
    for i in range(3):
        tree.write(NS, files_of(i), at=T0 + i, size=100)
    assert stats(tree) == (3, 12, 1200)
    (tree.dir(NS) / files_of(0)[1]).unlink()  # one pool file goes: the page stays
    tree.stored(NS, [files_of(0)[1]], at=T0 + 5)  # the watcher settles a vanished file
    assert stats(tree) == (3, 11, 1100)
    for name in files_of(1):
        (tree.dir(NS) / name).unlink()
    tree.stored(NS, files_of(1), at=T0 + 6)
    assert stats(tree) == (2, 7, 700)
    # the scan finds the index right as it is: nothing to reindex
    report = scan_namespace(tree.layout, tree.store, NS)
    assert (report.pages, report.files, report.bytes, report.drift) == (2, 7, 700, 0)


def test_a_reindex_counts_pages_as_the_events_do(tree: Tree) -> None:
    for i in range(4):
        tree.write(NS, files_of(i), at=T0 + i, size=10)
    with tree.store.transaction() as conn:
        conn.execute("DELETE FROM pages")  # a lost index: the scan rebuilds it from the disk
    assert stats(tree) == (0, 0, 0)
    report = scan_namespace(tree.layout, tree.store, NS)
    assert report.added == 16 and stats(tree) == (4, 16, 160)


def test_gc_evicts_whole_pages_and_leaves_none_partial(tree: Tree) -> None:
    for i in range(6):
        tree.write(NS, files_of(i), at=T0 + 10 * i)
    # 24 files of 1000 bytes over a 20,000-byte cap: down to 85% = 17,000, so 2 pages go.
    # Stored 10 s apart, by different requests: no chain, the oldest go first.
    plan = tree.plan(policy(max_bytes=20_000), now=T0 + 100)
    assert sorted(evicted(plan)) == sorted(files_of(0) + files_of(1))
    tree.execute(plan, now=T0 + 100)
    left = tree.files(NS)
    assert left == {n for i in range(2, 6) for n in files_of(i)}
    assert stats(tree) == (4, 16, 16_000)


def test_a_page_is_as_recent_as_its_most_recent_file(tree: Tree) -> None:
    """SGLang reads a pool's part only for a prefix's last pages: an old pool file must not
    drag out the page whose KV files are read."""
    tree.write(NS, files_of(0), at=T0)
    tree.write(NS, files_of(1), at=T0 + 10)
    tree.read(NS, [files_of(0)[0], files_of(0)[2]], at=T0 + 50)  # the KV parts only
    plan = tree.plan(policy(max_bytes=7_000), now=T0 + 100)
    assert sorted(evicted(plan)) == sorted(files_of(1))
    # with min_age, a page one of whose files was used lately is not a candidate at all
    plan = tree.plan(policy(max_bytes=7_000, min_age=60), now=T0 + 100)
    assert sorted(evicted(plan)) == sorted(files_of(1))


def test_a_torn_file_takes_its_whole_page(tree: Tree) -> None:
    for i in range(5):
        tree.write(NS, files_of(i), at=T0)
    torn = tree.dir(NS) / files_of(3)[1]  # one rank's mamba part, truncated
    torn.write_bytes(b"\0" * 10)
    tree.stored(NS, [torn.name], at=T0)
    plan = tree.plan(policy(), now=T0 + 100)
    assert sorted(evicted(plan, "corrupt")) == sorted(files_of(3))
    tree.execute(plan, now=T0 + 100)
    assert tree.files(NS) == {n for i in (0, 1, 2, 4) for n in files_of(i)}


def test_migration_5_counts_the_pages_rows_of_an_older_db_hold(tmp_path: Path) -> None:
    conn = connect(tmp_path / "state.db")
    migrate(conn, bundled_migrations()[:4])
    names = files_of(0) + files_of(1) + [page(2)]
    conn.executemany(
        "INSERT INTO pages (namespace_id, name, size, created_at, last_access)"
        " VALUES (?, ?, 5, 0, 0)",
        [(NS, n) for n in names],
    )
    migrate(conn)
    row = conn.execute("SELECT pages, files, bytes FROM namespace_stats").fetchone()
    assert tuple(row) == (3, 9, 45)
    assert {r[0] for r in conn.execute("SELECT DISTINCT key_len FROM pages")} == {64}
    with pytest.raises(sqlite3.IntegrityError, match="key_len"):
        conn.execute(
            "INSERT INTO pages (namespace_id, name, size, created_at, last_access)"
            " VALUES (?, ?, 5, 0, 0)",
            (NS, page(3)),
        )
    conn.close()


@pytest.mark.sglang
def test_pages_sglang_writes_with_pools_on_two_ranks_count_once(
    sglang: SglangDriver, tree: Tree
) -> None:
    d = tree.dir(NS)
    keys: set[str] = set()
    for rank in (0, 1):
        h = sglang.open(d, model="org/Hybrid", tp_rank=rank, tp_size=2)
        keys |= set(sglang.write(h, [[3, 256]])["keys"])
        sglang.write(h, [[3, 256]], pool="mamba")
    names = os.listdir(d)
    assert len(keys) == 4 and len(names) == 16
    report = scan_namespace(tree.layout, tree.store, NS)
    assert (report.pages, report.files) == (4, 16)
    assert stats(tree)[:2] == (4, 16)
    now = time.time() + 1  # the scan dated the pages by their mtime
    plan = tree.plan(policy(max_bytes=sum(os.path.getsize(d / n) for n in names) - 1), now=now)
    gone = evicted(plan)
    assert gone and {n[:64] for n in gone} <= keys and len(gone) % 4 == 0
    tree.execute(plan, now=now)
    left = os.listdir(d)
    assert all(sum(n.startswith(k) for n in left) in (0, 4) for k in keys)  # no partial page


def test_ls_status_and_metrics_count_pages_not_files(layout: Layout) -> None:
    d = register_namespace(layout, NS, instance="gpu0")
    for i in range(3):
        for name in files_of(i):
            store_page(d, name, 10)
    out = cli("--root", str(layout.root), "ls", "--json")
    assert out.returncode == 0, out.stderr
    (ns,) = json.loads(out.stdout)["namespaces"]
    assert (ns["pages"], ns["bytes"]) == (3, 120)
    out = cli("--root", str(layout.root), "status", "--json", "--port", "1")
    assert out.returncode == 0, out.stderr
    (ns,) = json.loads(out.stdout)["namespaces"]
    assert (ns["pages"], ns["bytes"]) == (3, 120)
    store = Store.open(layout.db_path)
    try:
        scan_namespace(layout, store, NS)
        reg = CollectorRegistry(auto_describe=False)
        reg.register(CachemgrCollector(layout, lambda: nullcontext(store.conn)))
        assert (
            reg.get_sample_value("cachemgr_namespace_pages", {"namespace": NS, "engine": "sglang"})
            == 3
        )
        assert (
            reg.get_sample_value("cachemgr_namespace_bytes", {"namespace": NS, "engine": "sglang"})
            == 120
        )
    finally:
        store.close()
