"""Per-file digests remembered in the state DB, valid while (dev, ino, size, mtime_ns) hold.

An unchanged 50-shard model then re-fingerprints with 50 stats and one query instead of
reading tens of GB.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from cachemgr.identity.hashing import FileStat
from cachemgr.state import digest_sql
from cachemgr.state.store import Store

# A file written within this many seconds of being hashed may be written again in the same
# mtime tick (coarse timestamps on some filesystems) without its key changing — git's "racy
# clean" problem. Such digests are used once but not remembered.
RACY_SECONDS = 2.0
_BATCH = 500  # stay well under SQLite's bound-variable limit


class DigestCache:
    """Lookups and upserts of file digests keyed by real path and algorithm."""

    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock

    def lookup(self, algo: str, files: Mapping[str, FileStat]) -> dict[str, str]:
        """Digests still valid for `files` (real path → current stat); misses are absent."""
        hits: dict[str, str] = {}
        paths = list(files)
        for start in range(0, len(paths), _BATCH):
            batch = paths[start : start + _BATCH]
            for path, dev, ino, size, mtime_ns, digest in digest_sql.cached_digests(
                self.store.conn, algo, batch
            ):
                if files[path] == FileStat(dev, ino, size, mtime_ns):
                    hits[path] = digest
        return hits

    def record(self, algo: str, digests: Mapping[str, tuple[FileStat, str]]) -> int:
        """Remember digests (real path → (stat, digest)) unless racy; returns how many."""
        now = self.clock()
        rows = [
            (path, algo, st.dev, st.ino, st.size, st.mtime_ns, digest, now)
            for path, (st, digest) in digests.items()
            if now - st.mtime_ns / 1e9 >= RACY_SECONDS
        ]
        if rows:
            with self.store.transaction() as conn:
                digest_sql.remember_digests(conn, rows)
        return len(rows)
