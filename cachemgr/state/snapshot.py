"""A private in-memory copy of the state DB, for commands that must not write under the root.

`ls`, `status`, `doctor` and the dry runs adopt namespaces from disk and bring the page index
in line before they read; in a copy those writes touch nothing on disk: no DB created where
there was none, no -wal/-shm files, no space reserve, no row changed under a running daemon.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from cachemgr.errors import StateLocked
from cachemgr.state.busy import describe_holders, is_locked
from cachemgr.state.dbfile import FileId, file_id, is_corrupt, quick_check
from cachemgr.state.store import BUSY_TIMEOUT, Store, connect, migrate


def snapshot(path: Path) -> Store:
    """The DB at `path` copied into memory and migrated there; an empty one if there is none
    (the caller learns the namespaces from disk, as after a lost DB).

    A corrupt DB is the one write: it is moved aside and started afresh, as every command
    does (Store.open), so that the daemon and the next command do not trip on it again.
    """
    mem = connect(Path(":memory:"))
    copied: FileId | None = None
    try:
        if path.is_file():
            try:
                _copy(path, mem)
            except sqlite3.DatabaseError as e:
                if not is_corrupt(e):
                    raise
                Store.open(path, check=True).close()  # moved aside (a warning says where), fresh DB
                _copy(path, mem)
            copied = file_id(path)  # a corruption found later moves this file aside
        migrate(mem)
    except BaseException:
        mem.close()
        raise
    return Store(mem, path, copied)


def _copy(path: Path, into: sqlite3.Connection) -> None:
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
        src.backup(into)
    finally:
        src.close()
    # The copy is page by page, sound or not; checked here (in memory, cheap) so a corrupt
    # DB is handled now, as Store.open does, not by a statement halfway through a command.
    quick_check(into)
