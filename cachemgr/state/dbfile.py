"""The state DB as a file: which file the path names, its lock, and moving a corrupt one aside.

A corrupt DB is only ever moved (to <name>.corrupt-<unix time>, with its -wal/-shm), never
deleted: it holds the audit history, and `doctor` lists such copies.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from cachemgr.errors import StateError, StateUnavailable
from cachemgr.fs.deletecheck import DENIED
from cachemgr.fs.safe import open_file
from cachemgr.layout import DB_SUFFIXES, recover_lock

log = logging.getLogger(__name__)
FileId = tuple[int, int]


@contextmanager
def path_lock(path: Path) -> Iterator[None]:
    """Held while changing what the DB path holds: its schema, or the file (moved aside).

    flock, so threads of one process exclude each other too (each opens its own fd).
    """
    name = recover_lock(path)
    try:
        fd = open_file(name, os.O_RDWR | os.O_CREAT)
    except OSError as e:
        raise StateError(f"cannot open {name}: {e.strerror}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def is_corrupt(e: BaseException | None) -> bool:
    """Whether SQLite said the file is not a database or is malformed (not: newer schema).

    Follows the causes and contexts: a failed rollback after a corrupt read still counts.
    """
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, sqlite3.DatabaseError):
            code = getattr(e, "sqlite_errorcode", None)
            if code in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT) or any(
                m in str(e) for m in ("file is not a database", "disk image is malformed")
            ):
                return True
        e = e.__cause__ or e.__context__
    return False


@contextmanager
def denied_as_unavailable(state_dir: Path) -> Iterator[None]:
    """The kernel refusing this process a file of `state_dir` is StateUnavailable (an HTTP
    503 naming the dir and the fix), not an internal error; other errors pass."""
    try:
        yield
    except OSError as e:
        where = os.fsdecode(e.filename) if e.filename is not None else ""
        if e.errno not in DENIED or not where.startswith(os.fspath(state_dir)):
            raise
        raise StateUnavailable(
            f"state dir {state_dir} cannot be used by uid {os.getuid()} ({e.strerror}); give "
            "this user read, write and search on it (chmod u+rwx, or chown it)"
        ) from e


def unavailable(state_dir: Path, db: Path) -> StateUnavailable | None:
    """Why the state DB at `db` cannot be reached now, else None (one stat)."""
    try:
        with denied_as_unavailable(state_dir):
            file_id(db)
    except StateUnavailable as e:
        return e
    return None


def file_id(path: Path) -> FileId | None:
    """(st_dev, st_ino) of the file at `path`, None if there is none."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def quarantine(path: Path, found: FileId | None, why: BaseException) -> Path | None:
    """Move the corrupt DB `found` (and its -wal/-shm) to <name>.corrupt-<unix time>.

    Only if `path` still names that file, checked under the path's lock: two processes (or
    threads) finding the same corrupt file must not move aside the fresh DB the first one
    made. Returns where it went, None if it was no longer there. The caller rebuilds from disk.
    """
    with path_lock(path):
        if found is None or file_id(path) != found:
            return None
        stem = f"{path.name}.corrupt-{int(time.time())}"
        aside, n = path.with_name(stem), 1
        while os.path.lexists(aside):  # a second corruption within the second
            n += 1
            aside = path.with_name(f"{stem}-{n}")
        for suffix in DB_SUFFIXES:
            with suppress(FileNotFoundError):
                os.rename(f"{path}{suffix}", f"{aside}{suffix}")
        log.warning(
            "state DB was corrupt; moved it aside and started a fresh one, rebuilt from disk",
            extra={"moved_to": str(aside), "error": str(why)},
        )
        return aside


def quick_check(conn: sqlite3.Connection) -> None:
    """Raise a corrupt-DB error unless PRAGMA quick_check finds the b-trees sound.

    It reads the whole file: ~35 ms warm, ~0.6 s cold for a 30 MB DB of 100K pages; the
    daemon pays it once at start, the CLI never (it recovers when a statement fails).
    """
    rows = conn.execute("PRAGMA quick_check(1)").fetchall()
    if [tuple(r) for r in rows] != [("ok",)]:
        raise sqlite3.DatabaseError(f"database disk image is malformed: {rows[0][0]}")
