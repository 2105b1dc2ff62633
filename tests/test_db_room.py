"""The state DB's room on the root's filesystem: GC plans as if its reserve were held and its
-wal file were as large as it grows between checkpoints, so the DB taking that room never puts
free space under the floor (a 2.6 MiB -wal beside a 73 KiB DB had, on a 64 MiB filesystem)."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest

from cachemgr.fs import reserve
from cachemgr.fs.root import create_root
from cachemgr.layout import DB_FILE, Layout
from cachemgr.state.store import connect


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    return layout


@pytest.fixture
def conn(layout: Layout) -> Iterator[sqlite3.Connection]:
    with closing(connect(layout.state_dir / DB_FILE)) as conn:
        conn.execute("CREATE TABLE scratch(x BLOB)")
        yield conn


def _wal(layout: Layout) -> int:
    return os.stat(layout.state_dir / f"{DB_FILE}-wal").st_blocks * 512


def test_gc_counts_the_wal_s_growth_to_its_checkpoint_size_as_used(
    layout: Layout, conn: sqlite3.Connection
) -> None:
    assert reserve.keep(layout.state_dir)
    conn.execute("PRAGMA wal_autocheckpoint=0")  # the -wal grows as a busy index's does
    before = reserve.missing_bytes(layout.state_dir, layout.root)
    assert before == reserve.WAL_BYTES - _wal(layout) > 0
    conn.execute("INSERT INTO scratch VALUES (zeroblob(1 << 20))")
    assert _wal(layout) > 1 << 20
    assert reserve.missing_bytes(layout.state_dir, layout.root) == reserve.WAL_BYTES - _wal(layout)


def test_a_long_transaction_s_wal_is_truncated_back_once_checkpointed(
    layout: Layout, conn: sqlite3.Connection
) -> None:
    conn.execute(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 8)"
        " INSERT INTO scratch SELECT zeroblob(1 << 20) FROM n"
    )
    assert _wal(layout) > 2 * reserve.WAL_BYTES
    conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
    conn.execute("INSERT INTO scratch VALUES (1)")  # the -wal starts over: cut to the limit
    assert _wal(layout) <= reserve.WAL_BYTES
    assert reserve.missing_bytes(layout.state_dir, layout.root) >= 0
