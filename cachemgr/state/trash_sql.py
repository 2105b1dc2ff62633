"""The statements on the trash_counts table: what a purge moved into each .trash/ entry, less
what drains deleted of it since (migration 0009)."""

from __future__ import annotations

import sqlite3


def record(conn: sqlite3.Connection, entry: str, files: int, size: int) -> None:
    """A purge moved `files` files of `size` bytes into .trash/<entry>."""
    conn.execute(
        "INSERT OR REPLACE INTO trash_counts (entry, files, bytes) VALUES (?, ?, ?)",
        (entry, files, size),
    )


def recorded(conn: sqlite3.Connection) -> dict[str, tuple[int, int]]:
    """Each recorded entry's (files, bytes) left."""
    rows = conn.execute("SELECT entry, files, bytes FROM trash_counts")
    return {entry: (files, size) for entry, files, size in rows}


def drained(conn: sqlite3.Connection, entry: str, files: int, size: int) -> None:
    """A drain deleted this much of the entry. A count that reaches 0 is forgotten: what the
    entry still holds then (foreign names, files left by hand) is counted by a scan."""
    conn.execute(
        "UPDATE trash_counts SET files = files - ?, bytes = max(0, bytes - ?) WHERE entry = ?",
        (files, size, entry),
    )
    conn.execute("DELETE FROM trash_counts WHERE entry = ? AND files <= 0", (entry,))


def forget(conn: sqlite3.Connection, entry: str) -> None:
    """The entry is gone, or its drain finished."""
    conn.execute("DELETE FROM trash_counts WHERE entry = ?", (entry,))
