"""A private in-memory copy of the state DB, for commands that must not write under the root.

`ls`, `status`, `doctor` and the dry runs adopt namespaces from disk and bring the page index
in line before they read; in a copy those writes touch nothing on disk: no DB created where
there was none, no -wal/-shm files, no space reserve, no row changed under a running daemon.

A copy for a command that reads no page rows (`ls`, `status`, `doctor`, `fingerprint`) leaves
the pages table empty: at millions of pages it is nearly all of the file (~300 B a page), and
copying it cost those commands seconds and hundreds of MiB. Damage in the page rows alone is
then left to what reads them (the daemon checks the whole file as it opens it).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from cachemgr.errors import StateLocked
from cachemgr.state.busy import describe_holders, is_locked
from cachemgr.state.dbfile import FileId, file_id, is_corrupt, quick_check
from cachemgr.state.store import (
    BUSY_TIMEOUT,
    Store,
    bundled_migrations,
    connect,
    migrate,
    user_version,
)

# Per page (one row or more each): left out of a copy made without page rows. Every other
# table has a row per namespace, instance, model file or GC run.
PAGE_TABLES = frozenset({"pages"})


def snapshot(path: Path, *, page_rows: bool = True) -> Store:
    """The DB at `path` copied into memory and migrated there; an empty one if there is none
    (the caller learns the namespaces from disk, as after a lost DB). Without `page_rows` the
    pages table is there and empty (its aggregates in namespace_stats are copied).

    A corrupt DB is the one write: it is moved aside and started afresh, as every command
    does (Store.open), so that the daemon and the next command do not trip on it again.
    """
    mem = connect(Path(":memory:"))
    copied: FileId | None = None
    try:
        if path.is_file():
            try:
                _copy(path, mem, page_rows)
            except sqlite3.DatabaseError as e:
                if not is_corrupt(e):
                    raise
                Store.open(path, check=True).close()  # moved aside (a warning says where), fresh DB
                mem.close()
                mem = connect(Path(":memory:"))  # a light copy may have failed halfway
                _copy(path, mem, page_rows)
            copied = file_id(path)  # a corruption found later moves this file aside
        migrate(mem, db=path)
    except BaseException:
        mem.close()
        raise
    return Store(mem, path, copied)


def _copy(path: Path, into: sqlite3.Connection, page_rows: bool) -> None:
    """Copy without creating -wal/-shm: with no WAL beside it the file is the whole DB and is
    read as immutable; with one (a writer is open) it is read through it, which exists already."""
    has_wal = Path(f"{path}-wal").exists()
    uri = path.absolute().as_uri() + ("?mode=ro" if has_wal else "?immutable=1")
    src = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT, isolation_level=None)
    try:
        # sqlite3's backup retries a locked source for ever, without a word (a foreign
        # `locking_mode=EXCLUSIVE` holds it as long as it likes): take the read lock here,
        # where the busy timeout bounds the wait; the backup then reads under it.
        try:
            src.execute("BEGIN")
            src.execute("SELECT count(*) FROM sqlite_master").fetchall()
        except sqlite3.OperationalError as e:
            if not is_locked(e):
                raise
            raise StateLocked(
                f"state DB {path} is locked by {describe_holders(path)}; waited "
                f"{BUSY_TIMEOUT:.0f} s to read it: try again once it is released"
            ) from e
        if page_rows or user_version(src) < bundled_migrations()[-1].version:
            src.backup(into)  # a migration may read the page rows: all of them, then
        else:
            _copy_schema_and_small_tables(src, into)
    finally:
        src.close()
    # A backup is page by page, sound or not; checked here (in memory, cheap) so a corrupt
    # DB is handled now, as Store.open does, not by a statement halfway through a command.
    quick_check(into)


def _copy_schema_and_small_tables(src: sqlite3.Connection, into: sqlite3.Connection) -> None:
    """Every table, index and trigger of `src` in `into`, and the rows of all but PAGE_TABLES.

    The rows go in before the triggers exist: they are copies of rows whose aggregates
    (namespace_stats) are copied as they are, not to be counted again."""
    schema = src.execute(
        "SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL"
        " AND substr(name, 1, 7) != 'sqlite_' ORDER BY rowid"
    ).fetchall()
    into.execute("BEGIN")
    for kind, _name, sql in schema:
        if kind == "table":
            into.execute(sql)
    for kind, name, _sql in schema:
        if kind == "table" and name not in PAGE_TABLES:
            rows = src.execute(f'SELECT * FROM "{name}"')
            marks = ", ".join("?" * len(rows.description))
            into.executemany(f'INSERT INTO "{name}" VALUES ({marks})', rows)
    for kind, _name, sql in schema:
        if kind != "table":
            into.execute(sql)
    into.execute(f"PRAGMA user_version = {user_version(src)}")
    into.execute("COMMIT")
