from __future__ import annotations

import sqlite3
import threading
from functools import reduce
from pathlib import Path

import pytest

from cachemgr.errors import StateError
from cachemgr.fs._dirscan import page_digest
from cachemgr.state.store import (
    Migration,
    Store,
    bundled_migrations,
    connect,
    migrate,
    user_version,
)

TABLES = {"namespaces", "bindings", "pages", "digest_cache", "audit"}


def tables(conn: sqlite3.Connection) -> set[str]:
    rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    return {r[0] for r in rows} - {"sqlite_sequence"}


def test_fresh_db_gets_full_schema_and_wal(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s" / "state.db")
    assert tables(store.conn) >= TABLES
    assert user_version(store.conn) == len(bundled_migrations())
    assert store.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


def test_rerunning_migrations_is_a_no_op(tmp_path: Path) -> None:
    Store.open(tmp_path / "state.db").close()
    conn = connect(tmp_path / "state.db")
    before = conn.execute("SELECT sql FROM sqlite_master ORDER BY name").fetchall()
    assert migrate(conn) == []
    assert conn.execute("SELECT sql FROM sqlite_master ORDER BY name").fetchall() == before


def test_newer_db_is_refused(tmp_path: Path) -> None:
    conn = connect(tmp_path / "state.db")
    conn.execute("PRAGMA user_version = 999")
    conn.close()
    with pytest.raises(StateError, match="schema version 999, newer than this cachemgr"):
        Store.open(tmp_path / "state.db")


def test_failed_migration_leaves_previous_version(tmp_path: Path) -> None:
    conn = connect(tmp_path / "state.db")
    good = Migration(1, "0001_a.sql", "CREATE TABLE a (x INTEGER);")
    bad = Migration(2, "0002_b.sql", "CREATE TABLE b (x INTEGER); INSERT INTO nowhere VALUES (1);")
    with pytest.raises(StateError, match=r"0002_b\.sql failed"):
        migrate(conn, [good, bad])
    assert user_version(conn) == 1
    assert tables(conn) == {"a"}  # b's CREATE TABLE was rolled back with the failed insert
    assert migrate(conn, [good]) == []


def test_migrations_apply_in_order(tmp_path: Path) -> None:
    conn = connect(tmp_path / "state.db")
    first = Migration(1, "0001_a.sql", "CREATE TABLE a (x INTEGER);")
    second = Migration(2, "0002_b.sql", "ALTER TABLE a ADD COLUMN y INTEGER;")
    assert migrate(conn, [first]) == [1]
    assert migrate(conn, [first, second]) == [2]
    assert [r[1] for r in conn.execute("PRAGMA table_info(a)")] == ["x", "y"]


def test_transaction_rolls_back_on_error(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    with pytest.raises(RuntimeError), store.transaction():
        store.audit("purge", namespace_id=None, reason="test", actor="cli")
        raise RuntimeError
    assert store.conn.execute("SELECT count(*) FROM audit").fetchone()[0] == 0
    with store.transaction():
        store.audit("purge", namespace_id=None, reason="test", actor="cli", pages=3)
    assert store.conn.execute("SELECT pages FROM audit").fetchone()[0] == 3
    store.close()


def test_index_digest_migration_sums_the_rows_already_there(tmp_path: Path) -> None:
    conn = connect(tmp_path / "state.db")
    migrate(conn, bundled_migrations()[:3])  # a DB from before the digest
    rows = [("0123456789abcdef", f"{i:064x}_m_0_1.bin", 100 + i) for i in range(20)]
    conn.executemany(
        "INSERT INTO pages (namespace_id, name, size, created_at, last_access)"
        " VALUES (?, ?, ?, 0, 0)",
        rows,
    )
    migrate(conn)
    want = reduce(lambda d, r: d ^ page_digest(r[1], r[2]), rows, 0)
    assert tuple(conn.execute("SELECT pages, digest FROM namespace_stats").fetchone()) == (20, want)


def test_threads_creating_one_db_at_once_all_open_it(tmp_path: Path) -> None:
    """A DB deleted under the daemon is re-created by whichever thread reads or writes next (the
    index, the metrics snapshot, HTTP): the switch to WAL must not fail the ones that lose."""
    errors: list[BaseException] = []
    for round_ in range(20):
        path = tmp_path / f"state{round_}.db"
        barrier = threading.Barrier(4)

        def open_one(path: Path = path, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                connect(path).close()
            except StateError as e:
                errors.append(e)

        threads = [threading.Thread(target=open_one) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []


def test_name_length_migration_takes_the_longest_name_already_there(tmp_path: Path) -> None:
    conn = connect(tmp_path / "state.db")
    migrate(conn, bundled_migrations()[:11])  # a DB from before the names' length
    names = [f"{i:064x}_m_0_1.bin" for i in range(3)] + [f"{9:064x}.draft_swa_m_12_16.bin"]
    conn.executemany(
        "INSERT INTO pages (namespace_id, name, size, created_at, last_access, key_len)"
        " VALUES ('0123456789abcdef', ?, 10, 0, 0, 64)",
        [(n,) for n in names],
    )
    migrate(conn)
    assert conn.execute("SELECT name_len FROM namespace_stats").fetchone()[0] == len(names[-1])
    longer = f"{7:064x}.deepseek_v4_c4_indexer_scale_m_0_1.bin"  # the trigger keeps it since
    conn.execute(
        "INSERT INTO pages (namespace_id, name, size, created_at, last_access, key_len)"
        " VALUES ('0123456789abcdef', ?, 10, 0, 0, 64)",
        (longer,),
    )
    conn.execute("DELETE FROM pages WHERE name = ?", (longer,))  # (and never lowers it)
    assert conn.execute("SELECT name_len FROM namespace_stats").fetchone()[0] == len(longer)
