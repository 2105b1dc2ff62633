"""A private in-memory copy of the state DB, for commands that must not write under the root.

`ls`, `status`, `doctor` and the dry runs adopt namespaces from disk and bring the page index
in line before they read; in a copy those writes touch nothing on disk: no DB created where
there was none, no -wal/-shm files, no space reserve, no row changed under a running daemon.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

from cachemgr.state.store import Store, connect, migrate

log = logging.getLogger(__name__)


def snapshot(path: Path) -> Store:
    """The DB at `path` copied into memory and migrated there; an empty one if there is none
    or it cannot be read (the caller learns the namespaces from disk, as after a lost DB)."""
    mem = connect(Path(":memory:"))
    if path.is_file():
        try:
            _copy(path, mem)
        except sqlite3.Error as e:
            log.warning("state DB unreadable, using the disk alone", extra={"db": str(path),
                        "error": str(e)})  # fmt: skip
            mem.close()
            mem = connect(Path(":memory:"))
    migrate(mem)
    return Store(mem, path, None)


def _copy(path: Path, into: sqlite3.Connection) -> None:
    """Copy without creating -wal/-shm: with no WAL beside it the file is the whole DB and is
    read as immutable; with one (a writer is open) it is read through it, which exists already."""
    has_wal = Path(f"{path}-wal").exists()
    uri = path.absolute().as_uri() + ("?mode=ro" if has_wal else "?immutable=1")
    src = sqlite3.connect(uri, uri=True)
    try:
        src.backup(into)
    finally:
        src.close()
