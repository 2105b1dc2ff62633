"""The state DB's write lock held by someone else: telling it from other errors, naming the
holder, and the process-wide tally that /metrics, /readyz and the log show.

Another process (a person's `sqlite3 state.db` left in `BEGIN IMMEDIATE`, a backup tool, a
CLI run) may hold the write lock for as long as it likes. Each write of this process waits
for it in `Store.transaction` (short busy timeouts, retried with backoff); this module keeps
count of who is waiting, since when, and who holds the lock, so that it is said once per
episode and never kills a thread.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from cachemgr.fs.locks import describe_pid, file_key, proc_locks
from cachemgr.fs.safe import refuse_non_regular
from cachemgr.layout import db_files

log = logging.getLogger(__name__)
_BUSY = {sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED}
_SHM_WRITE_LOCK = 120  # WAL mode: the writer holds this byte of the -shm file (sqlite3 wal.c)
# The DB file's lock bytes (sqlite3 os.c: PENDING_BYTE, RESERVED_BYTE, the SHARED range): a
# write lock there shuts readers out, as `locking_mode=EXCLUSIVE` does with no -shm at all.
_DB_LOCK_BYTES = (0x40000000, 0x400001FF)
PROC_LOCKS = Path("/proc/locks")


def is_locked(error: BaseException) -> bool:
    """Whether `error` is SQLite saying another connection holds a lock it needs."""
    if not isinstance(error, sqlite3.OperationalError):
        return False
    code = getattr(error, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _BUSY
    return "locked" in str(error)  # (built without the code: the message is all there is)


def holders(db: Path, locks: Path = PROC_LOCKS) -> list[int]:
    """Pids holding the write lock of WAL database `db` (its -shm file's writer byte), or an
    exclusive lock on the DB file itself, from /proc/locks; empty if unknown (another kernel
    view)."""
    wanted = []
    for name, first, last in (
        (f"{db}-shm", _SHM_WRITE_LOCK, _SHM_WRITE_LOCK),
        (str(db), *_DB_LOCK_BYTES),
    ):
        try:
            wanted.append((file_key(os.stat(name)), first, last))
        except OSError:
            continue
    return sorted(
        {
            lock.pid
            for lock in proc_locks(locks)
            if lock.kind in ("POSIX", "OFDLCK") and lock.access == "WRITE"
            for here, first, last in wanted
            if lock.file == here and lock.start <= last and first <= lock.end
        }
    )


def shuts_out_readers(db: Path) -> bool:
    """Whether another connection holds `db` so that even a read fails (`locking_mode=
    EXCLUSIVE`); asked without waiting, and without creating a missing DB."""
    # SQLite opens by path and writes the -shm even to read: never through a planted link.
    refuse_non_regular(db_files(db))
    try:
        conn = sqlite3.connect(f"{db.absolute().as_uri()}?mode=ro", uri=True, timeout=0)
    except sqlite3.Error:
        return False
    try:
        conn.execute("PRAGMA schema_version").fetchone()
    except sqlite3.Error as e:
        return is_locked(e)
    finally:
        conn.close()
    return False


def held_here(db: Path) -> bool:
    """Whether this process alone holds `db`'s write lock (another of its connections)."""
    return holders(db) == [os.getpid()]


def describe_holders(db: Path) -> str:
    """'pid 1234 (sqlite3)', 'this process', or 'an unknown process'."""
    pids = holders(db)
    if not pids:
        return "an unknown process"
    if pids == [os.getpid()]:  # (held_here)
        return "this process"
    return ", ".join(describe_pid(p) for p in pids if p != os.getpid())


@dataclass
class LockTally:
    """Writers of this process waiting for the DB's write lock, and the time they waited."""

    waiting: int = 0
    episodes: int = 0  # times a wait began with no episode open
    seconds_done: float = 0.0  # waits that ended
    holder: str = ""  # who held it when the current episode began
    db: str = ""
    # When the current episode began; it ends when a waiter takes the lock, not when one
    # gives up (a 10 s patience run out while the holder keeps it is the same episode).
    _since: float | None = None
    _starts: list[float] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @contextmanager
    def wait(self, db: Path) -> Iterator[None]:
        """Around one writer's wait; the first waiter of an episode logs who holds the lock."""
        start = time.monotonic()
        with self._lock:
            self.waiting += 1
            self._starts.append(start)
            first = self._since is None
            if first:
                self.episodes += 1
                self._since = start
                self.db, self.holder = str(db), describe_holders(db)
        if first:
            # (This process's own other writer: a long scan; not worth a warning.)
            (log.debug if self.holder == "this process" else log.warning)(
                "state DB write-locked by another connection; writes wait and are retried",
                extra={"db": str(db), "holder": self.holder},
            )
        taken = False
        try:
            yield
            taken = True
        finally:
            self._done(start, taken)

    def _done(self, start: float, taken: bool) -> None:
        """One wait over: the episode ends if it took the lock."""
        with self._lock:
            self.waiting -= 1
            self._starts.remove(start)
            self.seconds_done += time.monotonic() - start
        if taken:
            self.took()

    def took(self) -> None:
        """A writer has the lock: an open episode ends, said once."""
        if self._since is None:  # (the common case, read without the lock)
            return
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            (log.debug if self.holder == "this process" else log.warning)(
                "state DB write lock free again",
                extra={
                    "db": self.db,
                    "holder": self.holder,
                    "seconds": round(time.monotonic() - since, 1),
                },
            )

    def seconds(self) -> float:
        """Seconds writers spent waiting, the waits still running included."""
        now = time.monotonic()
        with self._lock:
            return self.seconds_done + sum(now - s for s in self._starts)

    def held_elsewhere(self, longer_than: float) -> str | None:
        """Who holds the DB's write lock if the episode of waits for it has lasted more than
        `longer_than` seconds (between a writer's give-up and its retry too), unless it is
        this process itself (a long scan of its own ends by itself); else None."""
        with self._lock:
            since = self._since
            if since is None or self.holder == "this process":
                return None
            return self.holder if time.monotonic() - since > longer_than else None

    def degraded(self) -> str | None:
        """What /readyz says while a writer waits, else None."""
        with self._lock:
            if not self._starts or self._since is None:
                return None
            since = time.monotonic() - self._since
            return (
                f"state DB {self.db} write-locked by {self.holder} for {since:.0f} s; "
                "index, GC and purges wait for it"
            )


# One per process, like the process's own lock table: every Store of it waits on one DB lock.
LOCKS = LockTally()
