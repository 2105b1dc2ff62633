"""Applying a batch of watcher page events to the index, settled by a stat of each file.

Page stores and deletions are settled by a stat of the file at apply time (the disk is the
truth, so a create+delete inside one batch, or an event seen twice, needs no ordering care);
reads bump the page's `reads` and `last_access`, and every read and store takes the next
`access_seq` (GC's order inside a burst).
"""

from __future__ import annotations

import os
from collections import Counter

from cachemgr.backends import FileFormat
from cachemgr.daemon.watcher import Event, Kind
from cachemgr.layout import Layout
from cachemgr.sglang.hicache import HICACHE_FILE
from cachemgr.state import pages_sql
from cachemgr.state.store import Store


class PageEvents:
    """Applies page events to the index, giving each read and write a global sequence number.

    A request reads its pages front to back and writes new ones after them, so the sequence
    tells GC which pages of a burst are further down a prefix chain (cachemgr.gc.order); the clock
    does not (a burst of thousands of reads shares one batch time). The counter resumes after
    the largest stored value, so the order survives a restart.
    """

    def __init__(self, layout: Layout, store: Store, fmt: FileFormat = HICACHE_FILE) -> None:
        self.store, self.layout, self.fmt = store, layout, fmt
        self._next: int | None = None  # read at first use, on the thread that applies

    def apply(self, events: list[Event], *, now: float) -> dict[str, list[int]]:
        """Apply events in the order seen; returns [reads, writes] per namespace."""
        if not events:
            return {}
        if self._next is None:
            self._next = pages_sql.max_access_seq(self.store.conn) + 1
        touched: dict[tuple[str, str], bool] = {}  # (ns, name) -> stored in this batch
        reads: Counter[tuple[str, str]] = Counter()
        seqs: dict[tuple[str, str], int] = {}  # (ns, name) -> sequence of its last access
        per_ns: dict[str, list[int]] = {}  # ns -> [reads, writes]
        seq = self._next
        for kind, ns, name, _ in events:
            tally = per_ns.setdefault(ns, [0, 0])
            key = (ns, name)
            if kind is Kind.READ:
                reads[key] += 1
                tally[0] += 1
                seqs[key] = seq
                seq += 1
            else:
                stored = kind is Kind.WRITE
                touched[key] = touched.get(key, False) or stored
                tally[1] += stored
                if stored:
                    seqs[key] = seq
                    seq += 1
        self._next = seq
        upserts, deletes = self._settle(touched, seqs, now)
        with self.store.transaction() as conn:
            pages_sql.upsert_pages(conn, upserts)
            pages_sql.delete_pages(conn, deletes)
            pages_sql.add_reads(conn, ((n, now, seqs[key], *key) for key, n in reads.items()))
            for ns, (r, w) in per_ns.items():
                pages_sql.add_lifetime(conn, ns, r, w, now)
        return per_ns

    def _settle(
        self, touched: dict[tuple[str, str], bool], seqs: dict[tuple[str, str], int], now: float
    ) -> tuple[list[tuple[str, str, int, float, float, int, int]], list[tuple[str, str]]]:
        """Split touched pages into rows to upsert (file exists) and rows to delete."""
        upserts, deletes = [], []
        for (ns, name), stored in touched.items():
            try:
                st = os.stat(os.path.join(self.layout.ns_root, ns, name), follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                deletes.append((ns, name))
                continue
            seen = now if stored else min(st.st_mtime, now)
            key_len = self.fmt.key_len(name) or len(name)  # the watcher passes pages only
            upserts.append((ns, name, st.st_size, seen, seen, seqs.get((ns, name), 0), key_len))
        return upserts, deletes
