"""The state DB as a file: which file the path names, its lock, and moving a corrupt one aside.

A corrupt DB is moved (to <name>.corrupt-<unix time>, with its -wal/-shm), not deleted: it holds
the audit history, and `doctor` lists such copies. Only the newest KEEP_CORRUPT are kept: a DB
corrupted again and again (a failing disk, a tool that keeps writing it) left one copy each,
as big as the DB, until the state dir was full.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import sqlite3
import stat
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
KEEP_CORRUPT = 3  # corrupt copies kept, the newest: each holds the audit history up to it


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
        _drop_old_copies(path)
        return aside


def corrupt_copies(db: Path) -> list[Path]:
    """The copies `quarantine` moved `db` to (regular files of its names only), oldest first;
    their -wal/-shm/-journal not listed."""
    name = re.compile(rf"{re.escape(db.name)}\.corrupt-(\d+)(?:-(\d+))?")
    found = []
    try:
        entries = list(os.scandir(db.parent))
    except OSError:
        return []  # no state dir yet, or not ours to read (doctor says so on its own)
    for entry in entries:
        m = name.fullmatch(entry.name)
        if m and entry.is_file(follow_symlinks=False):
            found.append(((int(m[1]), int(m[2] or 1)), Path(entry.path)))
    return [p for _, p in sorted(found)]


def _drop_old_copies(db: Path) -> None:
    """Remove all but the newest KEEP_CORRUPT copies of `db`, each with its -wal/-shm/-journal
    (regular files of exactly those names, nothing else), and say which in the log."""
    removed = []
    for copy in corrupt_copies(db)[:-KEEP_CORRUPT]:
        try:
            for f in (Path(f"{copy}{suffix}") for suffix in DB_SUFFIXES):
                with suppress(FileNotFoundError):
                    if stat.S_ISREG(os.lstat(f).st_mode):
                        os.unlink(f)
        except OSError as e:  # the recovery goes on: the copy stays, and doctor lists it
            log.warning(
                "could not remove an old corrupt state DB copy",
                extra={"copy": str(copy), "error": e.strerror},
            )
            continue
        removed.append(copy.name)
    if removed:
        log.warning(
            "removed older corrupt state DB copies, keeping the newest",
            extra={"removed": removed, "kept": KEEP_CORRUPT, "dir": str(db.parent)},
        )


def quick_check(conn: sqlite3.Connection) -> None:
    """Raise a corrupt-DB error unless PRAGMA quick_check finds the b-trees sound.

    It reads the whole file: ~35 ms warm, ~0.6 s cold for a 30 MB DB of 100K pages; the
    daemon pays it once at start, the CLI never (it recovers when a statement fails).
    """
    rows = conn.execute("PRAGMA quick_check(1)").fetchall()
    if [tuple(r) for r in rows] != [("ok",)]:
        raise sqlite3.DatabaseError(f"database disk image is malformed: {rows[0][0]}")
