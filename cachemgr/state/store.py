"""The state DB: SQLite in WAL mode, its schema applied from numbered migrations/*.sql files.

The DB is an index of what is on disk plus history (bindings, audit); it can always be rebuilt
from the disk, so it favours speed (synchronous=NORMAL) over surviving a power cut.
"""

from __future__ import annotations

import _sqlite3
import logging
import operator
import os
import re
import shlex
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from cachemgr import __version__
from cachemgr.errors import StateCorrupt, StateDiskFull, StateError, StateLocked
from cachemgr.fs import reserve
from cachemgr.fs._dirscan import page_digest, sql_functions
from cachemgr.fs.safe import open_file, refuse_non_regular
from cachemgr.layout import DB_SUFFIXES, db_files
from cachemgr.state import busy
from cachemgr.state.dbfile import FileId, file_id, is_corrupt, path_lock, quarantine, quick_check

log = logging.getLogger(__name__)
BUSY_TIMEOUT = 10.0  # seconds a statement waits for a lock (a transaction: see Store.patience)
LOCK_POLL = 0.5  # one wait of a transaction's BEGIN: a lock held longer is counted and logged
_MIGRATION_RE = re.compile(r"(\d{4})_[a-z0-9_]+\.sql")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def bundled_migrations() -> list[Migration]:
    """The migrations shipped with this code, in order (migrations/ is packaged inside)."""
    folder = resources.files("cachemgr") / "migrations"
    found = []
    for entry in folder.iterdir():
        m = _MIGRATION_RE.fullmatch(entry.name)
        if m:
            found.append(Migration(int(m.group(1)), entry.name, entry.read_text("utf-8")))
    found.sort(key=lambda mig: mig.version)
    versions = [mig.version for mig in found]
    if versions != list(range(1, len(found) + 1)):
        raise StateError(f"migrations are not numbered 1..n without gaps: {versions}")
    return found


def connect(path: Path) -> sqlite3.Connection:
    """Open the DB with the pragmas every connection needs; transactions are explicit."""
    try:
        conn = sqlite3.connect(
            path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT
        )
    except sqlite3.Error as e:
        raise StateError(f"cannot open state DB {path}: {e}") from e
    try:
        _set_wal(conn)
        conn.execute("PRAGMA synchronous=NORMAL")
        # The -wal file is room GC plans for (cachemgr.fs.reserve): a long transaction's is
        # truncated back to it once checkpointed, not kept at its peak.
        conn.execute(f"PRAGMA journal_size_limit={reserve.WAL_BYTES}")
        conn.execute("PRAGMA foreign_keys=ON")
        # Debian's and most distributions' SQLite is built with SECURE_DELETE on: every page
        # a delete frees is overwritten with zeros, so truncating a 10M-page namespace's rows
        # wrote the whole index again into the -wal (2.3 GB at 9M, past its reserve) and held the
        # write lock 42 s, and every checkpoint then copied it back. The index holds page
        # names and counts, nothing to scrub.
        conn.execute("PRAGMA secure_delete=OFF")
        _register_functions(conn)
    except sqlite3.Error as e:  # left open: closing it may delete a -wal file to be kept
        raise StateError(f"cannot open state DB {path}: {e}") from e
    conn.row_factory = sqlite3.Row
    return conn


def _set_wal(conn: sqlite3.Connection, wait: float = 10.0) -> None:
    """Switch to WAL. A DB another thread is creating at the same moment (both reopening one
    deleted under the daemon) refuses the switch with "database is locked" at once, without
    the busy timeout: retry within `wait` seconds."""
    deadline = time.monotonic() + wait
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class _XorAgg:
    """XOR of a column: how a namespace's page digests combine (order-free, self-inverse)."""

    def __init__(self) -> None:
        self.value = 0

    def step(self, value: int) -> None:
        self.value ^= value

    def finalize(self) -> int:
        return self.value


def _register_functions(conn: sqlite3.Connection) -> None:
    """The functions the `pages` triggers keep namespace_stats.digest with (migration 0004):
    in C where the sqlite3 module's SQLite can be reached (a Python one takes the GIL at each
    call of a trigger, mid-statement: a wait behind the daemon's other threads, per row)."""
    if not sql_functions(conn, _sqlite3.__file__):
        conn.create_function("cachemgr_page_digest", 2, page_digest, deterministic=True)
        conn.create_function("cachemgr_xor", 2, operator.xor, deterministic=True)
    conn.create_aggregate("cachemgr_xor_agg", 1, _XorAgg)


def user_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def pending(
    conn: sqlite3.Connection, migrations: list[Migration], db: Path | None = None
) -> list[Migration]:
    """Migrations not yet applied; refuses a DB newer than the code (`db`: its path, for the
    message)."""
    current = user_version(conn)
    latest = migrations[-1].version if migrations else 0
    if current > latest:
        raise StateError(newer_schema(current, latest, db))
    return [m for m in migrations if m.version > current]


def newer_schema(current: int, latest: int, db: Path | None) -> str:
    """The one line for a DB a newer cachemgr migrated (a rolled-back image): what to do.
    Never moved aside here: the newer daemon may still have it open (a rolling upgrade)."""
    said = f"state DB {db or ''} is at schema version {current}, newer than this cachemgr "
    said += f"({__version__}) knows ({latest}): a newer cachemgr wrote it; upgrade cachemgr, "
    if db is None:
        return said + "or, rolling back, move the state DB aside (docs/failure-modes.md)"
    # (Its -wal too: a fresh DB beside an old -wal would take the newer DB's pages back.)
    files = " ".join(shlex.quote(f"{db.name}{suffix}") for suffix in DB_SUFFIXES)
    aside = shlex.quote(f"{db.name}.schema-{current}")
    move = f'for f in {files}; do [ ! -e "$f" ] || mv "$f" {aside}"${{f#{db.name}}}"; done'
    return said + (
        "or, rolling back, stop every cachemgr using this state dir, then move the DB aside "
        "(the index is rebuilt from disk; its audit history stays in the copy): "
        f"cd {shlex.quote(str(db.parent))} && {move}"
    )


def migrate(
    conn: sqlite3.Connection, migrations: list[Migration] | None = None, db: Path | None = None
) -> list[int]:
    """Apply pending migrations, each in one transaction with its user_version bump (`db`:
    the DB's path, for the message refusing a newer one)."""
    applied = []
    for mig in pending(conn, bundled_migrations() if migrations is None else migrations, db):
        try:
            # executescript() commits any open transaction first, so the script carries its
            # own BEGIN/COMMIT and a failure leaves it open for the rollback below.
            conn.executescript(
                f"BEGIN IMMEDIATE;\n{mig.sql}\n;PRAGMA user_version = {mig.version};\nCOMMIT;"
            )
        except sqlite3.Error as e:
            if conn.in_transaction:
                conn.rollback()
            raise StateError(
                f"migration {mig.name} failed: {e}; DB left at its prior version"
            ) from e
        applied.append(mig.version)
    return applied


def _open_migrated(path: Path) -> sqlite3.Connection:
    _create(path)
    conn = connect(path)
    try:
        if pending(conn, bundled_migrations(), path):
            with path_lock(path):  # two openers of a fresh DB: one migrates, one sees it done
                migrate(conn, db=path)
    except BaseException:
        conn.close()
        raise
    return conn


def _create(path: Path) -> None:
    """Make an absent DB file ourselves: SQLite makes it 0644 whatever the umask, and then an
    engine's `init` in the daemon's group (UMask=0002) could not write it (its -wal and -shm
    take the DB's mode)."""
    try:
        os.close(open_file(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        pass
    except OSError as e:
        raise StateError(f"cannot open state DB {path}: {e.strerror or e}") from e


def _open_with_room(path: Path) -> sqlite3.Connection:
    """Open; on a full filesystem give the state dir's reserve back and try once more."""
    try:
        return _open_migrated(path)
    except (StateError, sqlite3.DatabaseError) as e:
        if not reserve.is_disk_full(e, path.parent):
            raise
        if reserve.release(path.parent):
            with suppress(StateError, sqlite3.DatabaseError):
                return _open_migrated(path)
        free = reserve.free_bytes(path.parent)
        full = "no inode free" if reserve.no_inodes(path.parent) else f"{free} bytes free"
        # The fix depends on whether the root shares this filesystem (GC frees space only
        # there): the CLI, which knows the root, adds it.
        raise StateDiskFull(f"cannot open state DB {path}: its filesystem is full ({full})") from e


@contextmanager
def read_snapshot(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One read transaction (BEGIN … COMMIT), so a reader sees the DB at one moment while
    another connection writes (the GC plan while the watcher indexes)."""
    conn.execute("BEGIN")
    try:
        yield conn
    finally:
        conn.execute("COMMIT")


class Store:
    """A migrated connection to the state DB, with the queries shared across modules.

    It remembers which file it opened: `follow_path` reopens when the path names another
    file (the DB was deleted, or moved aside as corrupt by any process); `guard` (and leaving
    a `with Store.open(...)` block) turns a corrupt-DB error into StateCorrupt after moving
    the file aside, so the next use starts a fresh DB that the disk rebuilds.
    """

    def __init__(self, conn: sqlite3.Connection, path: Path, opened: FileId | None) -> None:
        self.conn, self.path, self.opened = conn, path, opened
        self.patience = BUSY_TIMEOUT  # seconds a transaction waits for another's write lock

    @classmethod
    def open(cls, path: Path, *, recover: bool = True, check: bool = False) -> Store:
        """Open and migrate; a file that is not a SQLite DB (or a corrupt one) is moved aside
        and a fresh DB started, unless `recover` is off. A DB newer than the code is refused.
        `check` runs PRAGMA quick_check first (see dbfile.quick_check for its cost)."""
        # SQLite opens by path and follows links: refuse one planted at its files first.
        refuse_non_regular(db_files(path))
        for _ in range(3):
            before = file_id(path)
            try:
                conn = _open_with_room(path)
            except (StateError, sqlite3.DatabaseError) as e:
                if not (recover and is_corrupt(e)):
                    raise
                quarantine(path, before, e)
                continue
            try:
                if check:
                    quick_check(conn)
            except sqlite3.DatabaseError as e:
                conn.close()
                if not recover:
                    raise StateCorrupt(f"state DB {path} is corrupt: {e}") from e
                quarantine(path, before, e)
                continue
            after = file_id(path)
            if before is None or before == after:  # else replaced while opening: open again
                reserve.keep(path.parent)
                return cls(conn, path, after)
            conn.close()
        raise StateError(f"cannot open state DB {path}: corrupt or replaced at every attempt")

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        self.close()
        if exc is not None:
            self._raise_if_corrupt(exc)

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Statements run inside raise StateCorrupt, not a raw sqlite3 error, if the DB is
        corrupt; the file is moved aside first (the next open or `follow_path` starts anew)."""
        try:
            yield
        except (sqlite3.DatabaseError, StateError) as e:
            self._raise_if_corrupt(e)
            raise

    def _raise_if_corrupt(self, exc: BaseException) -> None:
        if isinstance(exc, StateCorrupt) or not is_corrupt(exc):
            return
        aside = quarantine(self.path, self.opened, exc)
        where = f"moved it to {aside.name}" if aside else "another process moved it aside"
        raise StateCorrupt(
            f"state DB {self.path} is corrupt ({exc}); {where}: a fresh one is rebuilt from "
            "disk on next use (bindings from their files beside the manifests)"
        ) from exc

    def follow_path(self) -> bool:
        """Reopen if the path no longer names the file open (deleted, moved aside, replaced);
        True if it did. A process writing an unlinked DB would split the state in two."""
        if file_id(self.path) == self.opened:
            return False
        fresh = Store.open(self.path)
        old, self.conn, self.opened = self.conn, fresh.conn, fresh.opened
        # SQLite sees the old file moved and neither checkpoints nor deletes -wal/-shm by name.
        old.close()
        log.info("state DB file replaced or deleted; reopened it", extra={"db": str(self.path)})
        return True

    @contextmanager
    def transaction(self, *, patience: float | None = None) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE … COMMIT, rolled back on any exception. The write lock is waited
        for up to `patience` seconds (default `self.patience`; inf: until it comes), then
        StateLocked: nothing of the block ran."""
        self._begin(self.patience if patience is None else patience)
        try:
            yield self.conn
        except BaseException:
            with suppress(sqlite3.Error):  # a corrupt or vanished DB: the cause is what matters
                self.conn.rollback()
            raise
        self.conn.execute("COMMIT")

    def commit_and_begin(self) -> None:
        """Inside `transaction()`: commit what it wrote so far and begin again (waiting for the
        write lock as it did), for a row that must be durable before a change outside the DB
        (a purge's intent, before its rename). StateLocked: the rest of the block never ran."""
        self.conn.execute("COMMIT")
        self._begin(self.patience)

    def _begin(self, patience: float) -> None:
        """BEGIN IMMEDIATE, waiting out another connection's write lock in short busy
        timeouts with backoff; the wait is counted, and its first logged (state.busy)."""
        error = self._try_begin()
        if error is None:
            busy.LOCKS.took()  # (a give-up of an earlier wait left its episode open)
            return
        deadline = time.monotonic() + patience
        with busy.LOCKS.wait(self.path):
            pause = 0.05
            while error is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StateLocked(
                        f"state DB {self.path} is write-locked by "
                        f"{busy.describe_holders(self.path)}; waited {patience:.0f} s and "
                        "wrote nothing: try again once it is released"
                    ) from error
                time.sleep(min(pause, left))
                pause = min(pause * 2, 2.0)
                error = self._try_begin()

    def _try_begin(self) -> sqlite3.OperationalError | None:
        """BEGIN IMMEDIATE with a short busy timeout; the error if another holds the lock."""
        self.conn.execute(f"PRAGMA busy_timeout = {int(LOCK_POLL * 1000)}")
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:
            if not busy.is_locked(e):
                raise
            return e
        finally:
            self.conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT * 1000)}")
        return None

    def audit(
        self,
        action: str,
        *,
        namespace_id: str | None,
        reason: str,
        actor: str,
        pages: int = 0,
        bytes_: int = 0,
        at: float | None = None,
    ) -> None:
        """Record a destructive action (purge, eviction batch) and why."""
        self.conn.execute(
            "INSERT INTO audit (at, action, namespace_id, reason, actor, pages, bytes)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (time.time() if at is None else at, action, namespace_id, reason, actor, pages, bytes_),
        )
