"""The state DB: SQLite in WAL mode, its schema applied from numbered migrations/*.sql files.

The DB is an index of what is on disk plus history (bindings, audit); it can always be rebuilt
from the disk, so it favours speed (synchronous=NORMAL) over surviving a power cut.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from cachemgr.errors import StateError

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
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
    except sqlite3.Error as e:
        raise StateError(f"cannot open state DB {path}: {e}") from e
    conn.row_factory = sqlite3.Row
    return conn


def user_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def pending(conn: sqlite3.Connection, migrations: list[Migration]) -> list[Migration]:
    """Migrations not yet applied; refuses a DB newer than the code."""
    current = user_version(conn)
    latest = migrations[-1].version if migrations else 0
    if current > latest:
        raise StateError(
            f"state DB is at schema version {current}, newer than this cachemgr knows "
            f"({latest}); upgrade cachemgr or point --state-dir elsewhere"
        )
    return [m for m in migrations if m.version > current]


def migrate(conn: sqlite3.Connection, migrations: list[Migration] | None = None) -> list[int]:
    """Apply pending migrations, each in one transaction with its user_version bump."""
    applied = []
    for mig in pending(conn, bundled_migrations() if migrations is None else migrations):
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


class Store:
    """A migrated connection to the state DB, with the queries shared across modules."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    @classmethod
    def open(cls, path: Path) -> Store:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = connect(path)
        migrate(conn)
        return cls(conn)

    def close(self) -> None:
        self.conn.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE … COMMIT, rolled back on any exception."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            self.conn.rollback()
            raise
        self.conn.execute("COMMIT")

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
