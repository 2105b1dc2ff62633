"""The statements on the purge_intents table: a purge's (or GC drop's) audit row, recorded
before its rename (migrations 0010, 0011; cachemgr.ns.purge_intent says why)."""

from __future__ import annotations

import sqlite3
from dataclasses import astuple, dataclass, fields


@dataclass(frozen=True)
class Intent:
    """A purge about to move ns/<id> (the dir (dev, ino)) to .trash/<entry>, and its audit
    (`action`: "purge", or "evict" for GC's drop of an unbound namespace)."""

    entry: str
    namespace_id: str
    reason: str
    actor: str
    pages: int
    bytes: int
    at: float
    dev: int
    ino: int
    action: str = "purge"


_COLUMNS = ", ".join(f.name for f in fields(Intent))


def insert(conn: sqlite3.Connection, intent: Intent) -> None:
    conn.execute(
        f"INSERT INTO purge_intents ({_COLUMNS}) VALUES ({', '.join('?' * len(fields(Intent)))})",
        astuple(intent),
    )


def pending(conn: sqlite3.Connection, entry: str | None = None) -> list[Intent]:
    """The intents not settled yet (only `entry`'s, if given)."""
    where, args = ("WHERE entry = ?", (entry,)) if entry is not None else ("", ())
    rows = conn.execute(f"SELECT {_COLUMNS} FROM purge_intents {where}", args)
    return [Intent(*row) for row in rows]


def delete(conn: sqlite3.Connection, entry: str) -> bool:
    """Forget an intent; False if another connection settled it first."""
    return conn.execute("DELETE FROM purge_intents WHERE entry = ?", (entry,)).rowcount == 1
