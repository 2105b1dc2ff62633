"""The operator's commands at millions of pages (issue 23): `ls`, `status` and `doctor` read
no page rows, list no namespace dir a running daemon has indexed, and open no page; what they
leave out is said. Their times are bench/bench_cli.py's."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cachemgr.doctor.permissions import lint_deletable
from cachemgr.fs.leadership import Leadership
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from cachemgr.state.snapshot import snapshot
from cachemgr.state.store import bundled_migrations, connect, migrate
from tests.daemon_helpers import (
    NS_A,
    NS_B,
    page_name,
    register_namespace,
    running_daemon,
    store_page,
    wait_for,
)
from tests.gc_helpers import NS, T0, Tree, page
from tests.nsfixtures import cli
from tests.users import needs_root


def _rows(conn: sqlite3.Connection, table: str) -> list[tuple[object, ...]]:
    return [tuple(r) for r in conn.execute(f'SELECT * FROM "{table}" ORDER BY 1')]


def _schema(conn: sqlite3.Connection) -> set[tuple[str, str]]:
    return {(r[0], r[1]) for r in conn.execute("SELECT name, sql FROM sqlite_master")}


def test_a_copy_without_page_rows_keeps_every_other_row_and_the_aggregates(root: Path) -> None:
    """What ls, status and doctor read: the schema, the small tables and namespace_stats as the
    writer left them after stores, reads and deletes; the pages table empty."""
    tree = Tree.at(root)
    tree.write(NS, [page(i) for i in range(20)], at=T0)
    tree.read(NS, [page(3)], at=T0 + 5)
    with tree.store.transaction() as conn:
        conn.execute("DELETE FROM pages WHERE name IN (?, ?)", (page(1), page(2)))
    tree.add_namespace(NS_B, active=T0, bound=True)
    tree.store.close()
    src = connect(tree.layout.db_path)
    with snapshot(tree.layout.db_path, page_rows=False) as light:
        assert _schema(light.conn) == _schema(src)
        assert light.conn.execute("SELECT count(*) FROM pages").fetchone()[0] == 0
        stats = _rows(light.conn, "namespace_stats")
        assert stats == _rows(src, "namespace_stats")
        assert [(s[0], s[1], s[2]) for s in stats] == [(NS, 18, 18 * 1000)]
        for table in ("namespaces", "bindings", "audit", "notices", "digest_cache"):
            assert _rows(light.conn, table) == _rows(src, table), table
    with snapshot(tree.layout.db_path) as full:
        assert _rows(full.conn, "pages") == _rows(src, "pages")
    src.close()


def test_a_db_behind_the_code_is_copied_whole_for_its_migrations(tmp_path: Path) -> None:
    """A migration may count the page rows (0005 did): a DB at an older version is copied
    with them, then migrated, as before."""
    db = tmp_path / "state.db"
    conn = connect(db)
    migrate(conn, bundled_migrations()[:4])
    conn.execute(
        "INSERT INTO pages (namespace_id, name, size, created_at, last_access)"
        " VALUES (?, ?, 10, 1, 1)",
        (NS, page(1)),
    )
    conn.close()
    with snapshot(db, page_rows=False) as copy:
        assert copy.conn.execute("SELECT count(*) FROM pages").fetchone()[0] == 1
        stats = copy.conn.execute("SELECT pages, files, bytes FROM namespace_stats").fetchall()
        assert [tuple(r) for r in stats] == [(1, 1, 10)]


def test_ls_counts_from_the_index_of_the_daemon_serving_the_root(tmp_path: Path) -> None:
    """With a daemon serving the root, ls says the daemon's indexed pages and bytes (source
    daemon), as status does; they follow stores and deletes. Another root is counted on disk."""
    served, other = Layout.at(tmp_path / "served"), Layout.at(tmp_path / "other")
    create_root(served)
    create_root(other)
    d = register_namespace(served, NS_A, instance="gpu0")
    store_page(register_namespace(other, NS_B), page_name(1), 1000)
    with running_daemon(load_settings(root=served.root)) as dm:
        port = str(dm.daemon.port)

        def listed(layout: Layout) -> dict[str, object]:
            out = cli("--root", str(layout.root), "ls", "--json", "--port", port)
            assert out.returncode == 0, out.stderr
            return dict(json.loads(out.stdout))

        def indexed() -> int:
            (ns,) = dm.get("/v1/status").json()["namespaces"]
            return int(ns["pages"])

        for i in range(5):
            store_page(d, page_name(i), 1000)
        wait_for(indexed, lambda n: n == 5)
        report = listed(served)
        assert report["source"] == "daemon"
        (ns,) = report["namespaces"]  # type: ignore[attr-defined]
        assert (ns["ns_id"], ns["pages"], ns["bytes"], ns["state"]) == (NS_A, 5, 5000, "bound")
        for i in range(2):
            (d / page_name(i)).unlink()
        wait_for(indexed, lambda n: n == 3)
        (ns,) = listed(served)["namespaces"]  # type: ignore[misc]
        assert (ns["pages"], ns["bytes"]) == (3, 3000) == (len(os.listdir(d)), 3000)
        theirs = listed(other)
    assert theirs["source"] == "disk"
    assert [(n["ns_id"], n["pages"]) for n in theirs["namespaces"]] == [(NS_B, 1)]  # type: ignore[attr-defined]


def test_doctor_opens_no_page_the_daemon_would_count_as_read(tmp_path: Path) -> None:
    """doctor read each page's chattr flags by opening it: the daemon counted every doctor
    run as a read of every page (hit ratio, GC's recency). statx reads them unopened."""
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    d = register_namespace(layout, NS_A, instance="gpu0")
    for i in range(5):
        store_page(d, page_name(i), 1000)
    with running_daemon(load_settings(root=layout.root)) as dm:

        def counts() -> tuple[int, int]:
            (ns,) = dm.get("/v1/status").json()["namespaces"]
            return int(ns["pages"]), int(ns["page_reads"])

        wait_for(counts, lambda c: c[0] == 5)
        assert layout.gc_lock.exists()  # GC's user is known: doctor checks every page
        out = cli("--root", str(layout.root), "doctor", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        with open(d / page_name(0), "rb") as f:  # a real read, seen after doctor's events
            f.read()
        wait_for(counts, lambda c: c[1] >= 1)
        assert counts() == (5, 1)


def _gc_ran_as(layout: Layout, uid: int) -> None:
    lock = Leadership(layout.gc_lock)
    assert lock.try_acquire()
    lock.release()
    layout.gc_lock.write_text(f"pid 1 uid {uid} on host since then\n")


def test_doctor_says_how_many_pages_it_read_one_by_one(root: Path) -> None:
    """Past the sample, the pages' own checks stop and an info finding says so (exit 0);
    the whole namespace (--all-pages, or a smaller one) has no such finding."""
    tree = Tree.at(root)
    tree.write(NS, [page(i) for i in range(5)], at=T0)
    tree.store.close()
    _gc_ran_as(tree.layout, 0)
    (info,) = lint_deletable(tree.layout, sample=2)
    assert (info.severity, info.code) == ("info", "pages-sampled")
    assert info.message.startswith(f"ns {NS}: doctor read the flags and owner of 2 pages")
    assert "--all-pages" in info.fix
    assert lint_deletable(tree.layout, sample=5) == []
    assert lint_deletable(tree.layout, sample=None) == []


@contextmanager
def immutable(paths: list[Path]) -> Iterator[None]:
    subprocess.run(["chattr", "+i", *map(str, paths)], check=True)
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", *map(str, paths)], check=True)


@needs_root
def test_a_sampled_count_of_pinned_pages_says_at_least(root: Path) -> None:
    """Pinned pages found in a sample are a lower bound, and said to be; --all-pages counts
    every one."""
    tree = Tree.at(root)
    names = [page(i) for i in range(6)]
    tree.write(NS, names, at=T0)
    tree.store.close()
    _gc_ran_as(tree.layout, 0)
    with immutable([tree.dir(NS) / n for n in names[:4]]):
        (sampled,) = lint_deletable(tree.layout, sample=3)
        out = cli("--root", str(root), "doctor", "--json", "--all-pages")
    assert sampled.code == "gc-cannot-delete"
    assert re.match(rf"at least [1-3] pages in ns {NS} cannot be deleted", sampled.message)
    assert "a sample: doctor read the flags and owner of the first 3 pages" in sampled.message
    (whole,) = [f for f in json.loads(out.stdout) if f["code"] == "gc-cannot-delete"]
    assert whole["message"].startswith(f"4 pages in ns {NS} cannot be deleted by uid 0")
    assert "a sample:" not in whole["message"]


def test_commands_that_serve_no_http_import_no_web_framework() -> None:
    """fastapi and uvicorn cost ~0.3 s of every command's start; only `serve` needs them."""
    code = (
        "import sys\n"
        "from cachemgr.cli import main\n"
        "main._register()\n"
        "print(sorted({'fastapi', 'uvicorn', 'starlette'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
