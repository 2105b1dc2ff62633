"""A scan that stores its page rows as it walks (scan_usage's `rows`, the C scanner stepping an
INSERT on the caller's SQLite connection) gives the rows the Python listing gives, in both
engines' layouts; the index's first start walks its dir once."""

from __future__ import annotations

import os
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachemgr.backends import FileFormat, FileKind
from cachemgr.fs import dirscan
from cachemgr.fs.dirscan import PAGES, Rows, list_files, scan_usage
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.sglang.hicache import HICACHE_FILE
from cachemgr.state import index
from cachemgr.state.index import scan_namespace
from cachemgr.state.store import Store
from cachemgr.vllm.fstier import VLLM_FS_TIER
from tests.daemon_helpers import NS_A, page_name
from tests.test_dirscan import _NAMES
from tests.vllmtrees import sibling, vllm_namespace, vllm_tree, write_blocks, write_folder

ROW = "INSERT INTO temp.scan_rows VALUES (?, ?, ?, ?)"
Row = tuple[str, int, float, int]


@pytest.fixture
def conn() -> Iterator[sqlite3.Connection]:
    c = sqlite3.connect(":memory:", isolation_level=None)
    c.execute("CREATE TEMP TABLE scan_rows (name TEXT, size INTEGER, mtime REAL, key_len INTEGER)")
    yield c
    c.close()


def stored(conn: sqlite3.Connection) -> set[Row]:
    return set(conn.execute("SELECT name, size, mtime, key_len FROM temp.scan_rows"))


def listed(layout: Layout, rel: str, fmt: FileFormat, at: float) -> set[Row]:
    """What the Python listing says each page file's row is."""
    files = list_files(layout, rel, PAGES, fmt)
    return {(f.name, f.size, min(f.mtime, at), f.key_len) for f in files}


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    names=st.sets(_NAMES, min_size=1, max_size=40),
    ages=st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1),
)
def test_any_sglang_names_give_the_rows_the_listing_gives(
    tmp_path: Path, conn: sqlite3.Connection, names: set[str], ages: list[float]
) -> None:
    """Names of every shape, some mtimes in the future (stored as `at`)."""
    conn.execute("DELETE FROM temp.scan_rows")
    layout = Layout.at(Path(tempfile.mkdtemp(dir=tmp_path)))
    create_root(layout)
    d = layout.ns_dir(NS_A)
    d.mkdir()
    at = time.time()
    for i, name in enumerate(sorted(names)):
        (d / name).write_bytes(b"b" * (i % 3))
        t = at + ages[i % len(ages)]
        os.utime(d / name, (t, t))
    counted = scan_usage(layout, f"ns/{NS_A}", HICACHE_FILE)
    usage = scan_usage(layout, f"ns/{NS_A}", HICACHE_FILE, Rows(conn, ROW, at))
    assert usage == counted  # storing rows changes nothing the scan counts
    assert stored(conn) == listed(layout, f"ns/{NS_A}", HICACHE_FILE, at)
    assert len(stored(conn)) == (usage.files if usage else 0)


def test_a_vllm_tree_gives_the_rows_the_listing_gives(
    layout: Layout, store: Store, conn: sqlite3.Connection
) -> None:
    """Nested: each row is named by its path below the namespace dir, its key that whole path;
    blocks of a dir no identity file vouches for, temps, links and strays are not rows."""
    ns, d, folder = vllm_tree(layout, store)
    blocks = write_blocks(d, folder, 600)  # past SMALL: the stat threads run
    (d / sibling(blocks[0])).symlink_to(d / blocks[1])
    (d / f"{blocks[2]}_77.tmp").write_bytes(b"t")
    (d / "notes.txt").write_text("n")
    stray = d / "Other_0123456789ab_r0" / "abc" / "de_g0"
    stray.mkdir(parents=True)
    (stray / f"abcde{'0' * 59}.bin").write_bytes(b"x")
    usage = scan_usage(layout, f"ns/{ns}", VLLM_FS_TIER, Rows(conn, ROW, time.time()))
    rows = stored(conn)
    assert usage is not None and usage.files == len(rows) == 600
    assert rows == listed(layout, f"ns/{ns}", VLLM_FS_TIER, time.time())
    assert {(name, key_len) for name, _, _, key_len in rows} == {(b, len(b)) for b in blocks}


def test_a_failed_insert_stops_the_walk_and_is_raised_as_sqlite_would(
    layout: Layout, conn: sqlite3.Connection
) -> None:
    d = layout.ns_dir(NS_A)
    d.mkdir()
    for i in range(300):
        (d / page_name(i)).write_bytes(b"x" * (i % 7))
    conn.execute("DROP TABLE temp.scan_rows")
    conn.execute(
        "CREATE TEMP TABLE scan_rows (name TEXT, size INTEGER CHECK (size < 6), mtime REAL,"
        " key_len INTEGER)"
    )
    with pytest.raises(sqlite3.IntegrityError, match="CHECK constraint failed"):
        scan_usage(layout, f"ns/{NS_A}", HICACHE_FILE, Rows(conn, ROW, time.time()))
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        scan_usage(layout, f"ns/{NS_A}", HICACHE_FILE, Rows(conn, "INSERT INTO nope VALUES (?)", 0))


def test_other_connections_write_the_db_while_a_walk_stores_rows(layout: Layout) -> None:
    """The walk's transaction is on the temp database only: GC, purge and the CLI, on their own
    connections, are not locked out of the state DB for the minutes a big dir takes."""
    d = layout.ns_dir(NS_A)
    d.mkdir()
    for i in range(20):
        (d / page_name(i)).write_bytes(b"x")
    store = Store.open(layout.db_path)
    other = Store.open(layout.db_path)
    wrote: list[str] = []

    class Writing:  # SGLang's format, whose classify() writes through the other connection
        def __getattr__(self, name: str) -> object:
            return getattr(HICACHE_FILE, name)

        def classify(self, name: str) -> FileKind:
            # called by the C walk, mid-transaction, for each new shape
            with other.transaction(patience=0) as c:
                c.execute("INSERT INTO audit (at, action, reason, actor) VALUES (0, 't', 't', 't')")
            wrote.append(name)
            return HICACHE_FILE.classify(name)

    fmt = cast(FileFormat, Writing())
    report = scan_namespace(layout, store, NS_A, fmt=fmt)
    assert report.added == 20 and wrote  # indexed, and the other connection wrote meanwhile
    other.close()
    store.close()


def test_a_first_start_walks_the_dir_once_and_a_changed_dir_twice(
    layout: Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = layout.ns_dir(NS_A)
    d.mkdir()
    for i in range(50):
        (d / page_name(i)).write_bytes(b"x" * 10)
    walks: list[bool] = []
    real = index.scan_usage

    def counting(*args: object, **kw: object) -> object:
        walks.append(len(args) > 3 or "rows" in kw)
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(index, "scan_usage", counting)
    store = Store.open(layout.db_path)
    assert scan_namespace(layout, store, NS_A).added == 50
    assert walks == [True]  # nothing indexed: one walk, its rows stored
    walks.clear()
    assert scan_namespace(layout, store, NS_A).drift == 0
    assert walks == [False]  # unchanged: counted only
    walks.clear()
    (d / page_name(60)).write_bytes(b"x" * 10)
    (d / page_name(0)).unlink()
    report = scan_namespace(layout, store, NS_A)
    assert (report.added, report.removed) == (1, 1)
    assert walks == [False, True]  # changed: counted, then its rows listed
    store.close()


def test_where_c_cannot_reach_sqlite_the_rows_are_listed_in_python(
    layout: Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Python whose sqlite3 the C scanner cannot reach (a static build): the same index."""
    d = layout.ns_dir(NS_A)
    d.mkdir()
    for i in range(40):
        (d / page_name(i)).write_bytes(b"x" * (10 + i % 2))
    want = Store.open(layout.root / "want.db")
    scan_namespace(layout, want, NS_A)
    real = dirscan._dirscan.scan

    def unreachable(*args: object) -> object:
        if len(args) > 6 and args[6] is not None:
            raise NotImplementedError("SQLite's calls are not reachable from C")
        return real(*args)

    monkeypatch.setattr(dirscan._dirscan, "scan", unreachable)
    store = Store.open(layout.db_path)
    assert scan_namespace(layout, store, NS_A).added == 40
    query = "SELECT name, size, last_access, key_len FROM pages ORDER BY name"
    assert store.conn.execute(query).fetchall() == want.conn.execute(query).fetchall()
    store.close()
    want.close()


def test_a_vllm_folder_named_in_any_script_is_indexed(layout: Layout, store: Store) -> None:
    """A nested page's key is its whole path, counted in characters (SQLite's length(), which
    a trigger holds it to): a model name outside ASCII made every scan of such a tree fail."""
    ns = vllm_namespace(layout, store)
    d = layout.ns_dir(ns)
    folder = write_folder(d, model="Qwen/通义千问-7B")
    blocks = write_blocks(d, folder, 3)
    report = scan_namespace(layout, store, ns)
    assert report.added == 3
    rows = store.conn.execute("SELECT name, key_len FROM pages WHERE namespace_id = ?", (ns,))
    assert {tuple(r) for r in rows} == {(b, len(b)) for b in blocks}


def test_a_dir_name_that_is_not_utf8_is_not_the_engines(layout: Layout, store: Store) -> None:
    """The index stores paths as UTF-8 text: a folder whose name os.fsdecode() had to escape
    (a config.json naming its model so: no vLLM writes one) is foreign, its blocks not rows."""
    ns, d, folder = vllm_tree(layout, store)
    write_blocks(d, folder, 2)
    odd = write_folder(d, model="bad\udcff")
    assert os.fsencode(odd).startswith(b"bad\xff_")
    write_blocks(d, odd, 1)
    assert scan_namespace(layout, store, ns).added == 2
    assert scan_namespace(layout, store, ns).drift == 0  # and the count agrees


def test_a_failed_commit_of_the_rows_is_the_error_raised(
    layout: Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite ends a transaction itself on some failures (a full temp dir): the error raised is
    that failure's, not a ROLLBACK's of no transaction."""
    d = layout.ns_dir(NS_A)
    d.mkdir()
    (d / page_name(1)).write_bytes(b"x")
    store = Store.open(layout.db_path)

    def full(*args: object) -> object:
        store.conn.execute("ROLLBACK")  # (as SQLite does on SQLITE_FULL)
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(index, "scan_usage", lambda *a: full() if len(a) > 3 else None)
    with pytest.raises(sqlite3.OperationalError, match="disk is full"):
        scan_namespace(layout, store, NS_A)
    assert not store.conn.in_transaction
    store.close()
