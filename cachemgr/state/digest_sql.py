"""The statements on the digest cache table: per-file digests keyed by real path and algorithm,
with the (dev, ino, size, mtime_ns) they were computed for (cachemgr.identity.digest_cache)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence

# (path, algo, dev, ino, size, mtime_ns, digest, hashed_at)
DigestRow = tuple[str, str, int, int, int, int, str, float]


def cached_digests(
    conn: sqlite3.Connection, algo: str, paths: Sequence[str]
) -> list[tuple[str, int, int, int, int, str]]:
    """(path, dev, ino, size, mtime_ns, digest) remembered for these paths; keep `paths` short
    (SQLite bounds the variables of one statement)."""
    return conn.execute(
        "SELECT path, dev, ino, size, mtime_ns, digest FROM digest_cache"
        f" WHERE algo = ? AND path IN ({','.join('?' * len(paths))})",
        (algo, *paths),
    ).fetchall()


def remember_digests(conn: sqlite3.Connection, rows: Iterable[DigestRow]) -> None:
    """Store digests, replacing what was remembered for the same (path, algo)."""
    conn.executemany(
        "INSERT OR REPLACE INTO digest_cache"
        " (path, algo, dev, ino, size, mtime_ns, digest, hashed_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        rows,
    )
