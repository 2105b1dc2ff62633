"""The page index as GC needs it: observed accesses in order, and a reconcile scan of the disk.

The daemon's watcher feeds `Recorder.record` in event order; `reconcile` brings the index in
line with the disk when no daemon ran (the CLI) or after a lost event (inotify overflow).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from cachemgr.layout import NS_ID_RE, FileKind, Layout, classify
from cachemgr.store import Store

AccessKind = Literal["read", "write"]


class Recorder:
    """Records page reads and writes with a global sequence number, in observation order.

    A request reads its pages front to back and writes new ones after them, so the sequence
    tells GC which pages of a burst are further down a prefix chain. Timestamps alone do not:
    a burst of thousands of reads shares a few clock ticks. The counter is in-process and
    resumes after the largest stored value, so order survives a restart.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        row = store.conn.execute("SELECT COALESCE(MAX(access_seq), 0) FROM pages").fetchone()
        self._next = int(row[0]) + 1

    def record(
        self,
        namespace_id: str,
        accesses: Iterable[tuple[str, int | None]],
        *,
        at: float,
        kind: AccessKind,
    ) -> None:
        """Record (name, size) accesses in the order seen; size None = unknown (a read)."""
        reads = 1 if kind == "read" else 0
        with self.store.transaction() as conn:
            for name, size in accesses:
                seq, self._next = self._next, self._next + 1
                if size is None:
                    conn.execute(
                        "UPDATE pages SET last_access = ?, access_seq = ?, reads = reads + ?"
                        " WHERE namespace_id = ? AND name = ?",
                        (at, seq, reads, namespace_id, name),
                    )
                    continue
                conn.execute(
                    "INSERT INTO pages"
                    " (namespace_id, name, size, created_at, last_access, reads, access_seq)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT (namespace_id, name) DO UPDATE SET size = excluded.size,"
                    " last_access = excluded.last_access, access_seq = excluded.access_seq,"
                    " reads = reads + excluded.reads",
                    (namespace_id, name, size, at, at, reads, seq),
                )


@dataclass(frozen=True)
class TempFile:
    """An SGLang `.tmp` file found by a scan."""

    namespace_id: str
    name: str
    size: int
    mtime: float


@dataclass(frozen=True)
class ScanReport:
    """What a reconcile scan found and changed."""

    namespaces: tuple[str, ...]
    pages: int
    added: int
    removed: int
    resized: int
    temps: tuple[TempFile, ...]


def namespace_dirs(layout: Layout) -> list[str]:
    """Ids of the namespace directories under <root>/ns (real directories only)."""
    try:
        entries = list(os.scandir(layout.ns_root))
    except FileNotFoundError:
        return []
    return sorted(
        e.name for e in entries if NS_ID_RE.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
    )


def list_namespace(
    layout: Layout, ns_id: str
) -> tuple[dict[str, tuple[int, float]], list[TempFile]]:
    """Pages (name -> (size, mtime)) and temp files of one namespace dir; others are ignored."""
    pages: dict[str, tuple[int, float]] = {}
    temps: list[TempFile] = []
    try:
        entries = os.scandir(layout.ns_dir(ns_id))
    except FileNotFoundError:
        return pages, temps
    with entries:
        for e in entries:
            kind = classify(e.name)
            if kind is FileKind.FOREIGN:
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if kind is FileKind.PAGE:
                pages[e.name] = (st.st_size, st.st_mtime)
            else:
                temps.append(TempFile(ns_id, e.name, st.st_size, st.st_mtime))
    return pages, temps


def reconcile(store: Store, layout: Layout, *, now: float) -> ScanReport:
    """Make the page index agree with the disk; new pages get their mtime as last access."""
    ids = namespace_dirs(layout)
    pages = added = removed = resized = 0
    temps: list[TempFile] = []
    for ns_id in ids:
        on_disk, ns_temps = list_namespace(layout, ns_id)
        temps += ns_temps
        pages += len(on_disk)
        a, r, z = _reconcile_one(store, ns_id, on_disk, now)
        added, removed, resized = added + a, removed + r, resized + z
    with store.transaction() as conn:
        gone = [
            r[0]
            for r in conn.execute("SELECT namespace_id FROM namespace_stats WHERE pages > 0")
            if r[0] not in ids
        ]
        for ns_id in gone:  # the whole directory went away (a purge, an operator's rm -rf)
            removed += conn.execute("DELETE FROM pages WHERE namespace_id = ?", (ns_id,)).rowcount
    return ScanReport(tuple(ids), pages, added, removed, resized, tuple(temps))


def _reconcile_one(
    store: Store, ns_id: str, on_disk: dict[str, tuple[int, float]], now: float
) -> tuple[int, int, int]:
    indexed = dict(
        store.conn.execute("SELECT name, size FROM pages WHERE namespace_id = ?", (ns_id,))
    )
    new = [(n, s, m) for n, (s, m) in on_disk.items() if n not in indexed]
    gone = [n for n in indexed if n not in on_disk]
    grown = [(s, n) for n, (s, _) in on_disk.items() if n in indexed and indexed[n] != s]
    with store.transaction() as conn:
        conn.executemany(
            "INSERT INTO pages (namespace_id, name, size, created_at, last_access)"
            " VALUES (?, ?, ?, ?, ?)",
            [(ns_id, n, s, now, m) for n, s, m in new],
        )
        conn.executemany(
            "DELETE FROM pages WHERE namespace_id = ? AND name = ?", [(ns_id, n) for n in gone]
        )
        conn.executemany(
            "UPDATE pages SET size = ? WHERE namespace_id = ? AND name = ?",
            [(s, ns_id, n) for s, n in grown],
        )
    return len(new), len(gone), len(grown)
