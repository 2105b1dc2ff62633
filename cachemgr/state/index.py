"""The page index on disk → in the state DB: scans that make the `pages` table agree with the
files, without resetting what it knows about pages that stay.

A scan first counts the directory in C (cachemgr.fs.dirscan: pages, files, bytes and a digest of
every (name, size)); when the index's trigger-kept totals and digest equal those, the index already
matches and nothing else is read — the usual case on a restart or a periodic reconcile. Only
when they differ are the page files' rows listed, by a second walk in C, and the rows fixed
(`_reindex`); a namespace with nothing indexed yet (a first start) has its rows listed by the
first walk. A scan only lists and stats: it never opens a page file (an open would count as
a hit).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cachemgr.backends import FileFormat
from cachemgr.formats import format_for
from cachemgr.fs.dirscan import PAGES, Rows, Usage, list_files, scan_usage
from cachemgr.fs.safe import on_other_mount, open_dir
from cachemgr.layout import NS_DIR, NS_ID_RE, Layout
from cachemgr.state.registry_sql import identity_json
from cachemgr.state.store import Store

log = logging.getLogger(__name__)
BATCH = 10_000
SCAN_BATCH = 10_000  # rows per reindex transaction: other writers (GC, purge) get turns
PROGRESS_EVERY = 200_000  # rows between two progress lines of a long reindex
MAX_CHANGES = 65_536  # files added or removed past which a scan does not list them
ScanRow = tuple[str, int, int, float]  # (name, key_len, size, mtime) of a file a scan indexed
ScanChanges = tuple[list[ScanRow], list[tuple[str, int]]]  # (indexed, removed): ScanReport


@dataclass(frozen=True)
class ScanReport:
    """What one namespace dir held and what the scan changed in the index."""

    namespace_id: str
    pages: int = 0
    bytes: int = 0
    files: int = 0
    temp_files: int = 0
    foreign_files: int = 0
    corrupt_files: int = 0
    added: int = 0  # page files indexed that the index did not know
    removed: int = 0  # index rows whose file was gone
    seconds: float = 0.0
    # If asked for and not too many: (the files it indexed or found resized, as (name,
    # key_len, size, mtime); the (name, key_len) of the rows it removed).
    changes: ScanChanges | None = None

    @property
    def drift(self) -> int:
        """Rows the scan had to fix: zero when the watcher kept the index exact."""
        return self.added + self.removed


def namespace_dirs(layout: Layout) -> list[str]:
    """Ids of the namespace directories under <root>/ns (symlinks, mount points and strays
    ignored: the pages of a dir mounted there are not ours to index or delete)."""
    try:
        with open_dir(layout.root, NS_DIR) as fd, os.scandir(fd) as it:
            dirs = [e.name for e in it if e.is_dir(follow_symlinks=False)]
            return sorted(n for n in dirs if NS_ID_RE.fullmatch(n) and not on_other_mount(fd, n))
    except FileNotFoundError:
        return []


def scan_namespace(
    layout: Layout,
    store: Store,
    ns_id: str,
    *,
    now: Callable[[], float] = time.time,
    fmt: FileFormat | None = None,
    changes: bool = False,
) -> ScanReport:
    """Make the index of `ns_id` equal its directory; known pages keep their recency. The
    format defaults to that of the engine the registry's identity record names. `changes`:
    say which rows changed (ScanReport.changes), unless more than MAX_CHANGES did."""
    t0 = time.perf_counter()
    conn = store.conn
    fmt = fmt or engine_format(conn, ns_id)
    walk = _Walk(layout, conn, f"ns/{ns_id}", fmt, now)
    added = removed = 0
    diff: ScanChanges | None = ([], [])
    with _scan_rows(conn):
        # Nothing indexed yet (a first start, an adopted dir): the walk that counts the dir
        # stores its rows as well, so a ten-million-file dir is walked once, not twice.
        fresh = _count(conn, ns_id) == 0
        usage = walk(rows=fresh) or Usage()
        if not _matches(conn, ns_id, usage):
            log.info("reindexing namespace", extra={"namespace": ns_id, "pages": usage.pages})
            if not fresh:
                walk(rows=True)
            added, removed, diff = _reindex(store, ns_id, changes)
    report = ScanReport(
        ns_id,
        usage.pages,
        usage.bytes,
        usage.files,
        usage.temps,
        usage.other,
        usage.corrupt,
        added=added,
        removed=removed,
        seconds=time.perf_counter() - t0,
        changes=diff if changes else None,
    )
    with store.transaction() as conn:
        _record_scan(conn, report, now())
    return report


def engine_format(conn: sqlite3.Connection, ns_id: str) -> FileFormat:
    """The file format of a registered namespace (SGLang's if unregistered or unreadable)."""
    raw = identity_json(conn, ns_id)
    try:
        identity = json.loads(raw) if raw else None
    except ValueError:
        identity = None
    return format_for(identity if isinstance(identity, dict) else None)


def _matches(conn: sqlite3.Connection, ns_id: str, usage: Usage) -> bool:
    """Whether the index holds exactly the page files (names and sizes) the scan found."""
    row = conn.execute(
        "SELECT pages, files, bytes, digest FROM namespace_stats WHERE namespace_id = ?", (ns_id,)
    ).fetchone()
    return tuple(row or (0, 0, 0, 0)) == (usage.pages, usage.files, usage.bytes, usage.digest)


class _Walk:
    """One walk of a namespace dir: its usage, and with `rows` its page files' rows in
    temp.scan_rows (`_scan_rows`) as well."""

    def __init__(
        self,
        layout: Layout,
        conn: sqlite3.Connection,
        rel_dir: str,
        fmt: FileFormat,
        now: Callable[[], float],
    ) -> None:
        self.layout, self.conn, self.rel_dir, self.fmt, self.now = layout, conn, rel_dir, fmt, now

    def __call__(self, *, rows: bool) -> Usage | None:
        if not rows:
            return scan_usage(self.layout, self.rel_dir, self.fmt)
        # One transaction for the rows (of the temp database only: the main one is not
        # locked, other connections write on). Its rows are dropped with the table on a
        # failure; SQLite may have ended the transaction itself (a full temp dir).
        self.conn.execute("BEGIN")
        try:
            usage = self._rows(self.now())
            self.conn.execute("COMMIT")
        except BaseException:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise
        return usage

    def _rows(self, at: float) -> Usage | None:
        try:
            return scan_usage(self.layout, self.rel_dir, self.fmt, Rows(self.conn, _ROW, at))
        except NotImplementedError:  # the C scanner cannot reach this SQLite: list in Python
            usage = scan_usage(self.layout, self.rel_dir, self.fmt)
            files = list_files(self.layout, self.rel_dir, PAGES, self.fmt)
            rows = ((f.name, f.size, min(f.mtime, at), f.key_len) for f in files)
            self.conn.executemany(_ROW, rows)
            return usage


_ROW = "INSERT INTO temp.scan_rows VALUES (?, ?, ?, ?)"


@contextlib.contextmanager
def _scan_rows(conn: sqlite3.Connection) -> Iterator[None]:
    """A private temp table, temp.scan_rows, for the page rows a walk lists (dropped after)."""
    # A 64 MiB page cache (default 2 MiB) keeps the B-tree pages a bulk upsert revisits in
    # memory, for a bounded amount of RSS.
    conn.execute("PRAGMA cache_size = -65536")
    # The temp table is private and rebuilt every time: journaling it would copy each page it
    # reuses before writing it (a second reindex ran 10x slower on its temp inserts).
    conn.execute("PRAGMA temp.journal_mode = OFF")
    conn.execute("DROP TABLE IF EXISTS temp.scan_rows")
    conn.execute(
        "CREATE TEMP TABLE scan_rows (name TEXT, size INTEGER, mtime REAL, key_len INTEGER)"
    )
    try:
        yield
    finally:
        conn.execute("DROP TABLE IF EXISTS temp.scan_rows")
        conn.execute("PRAGMA cache_size = -2000")  # (SQLite's default: the big one is freed)


def _reindex(store: Store, ns_id: str, changes: bool) -> tuple[int, int, ScanChanges | None]:
    """Make the rows of `ns_id` those of its page files in temp.scan_rows: (rows added, rows
    removed, and if `changes` and not too many, which: ScanReport.changes).

    SQLite sorts the listed rows by name; rows then reach `pages` in primary-key order,
    SCAN_BATCH per transaction, so each B-tree page is written about once instead of once per
    batch (names are random hashes) and other writers get turns.
    """
    conn = store.conn
    conn.execute("CREATE INDEX temp.scan_rows_name ON scan_rows (name)")
    before = _count(conn, ns_id)
    diff = _diff(conn, ns_id) if changes else None
    with store.transaction():
        removed = conn.execute(
            "DELETE FROM pages WHERE namespace_id = ? AND name NOT IN (SELECT name FROM scan_rows)",
            (ns_id,),
        ).rowcount
    # A page first seen by a scan gets its mtime as created/last access: the best guess there
    # is (SGLang never rewrites a page) and it keeps GC order sane on a first install. Pages
    # already indexed keep their recency; only a changed size is written.
    upsert = (
        "INSERT INTO pages (namespace_id, name, size, created_at, last_access, key_len)"
        " SELECT ?, name, size, mtime, mtime, key_len FROM scan_rows WHERE name > ?"
        " ORDER BY name LIMIT ?"
        " ON CONFLICT (namespace_id, name) DO UPDATE SET size = excluded.size"
        " WHERE size != excluded.size"
    )
    last, done = "", 0
    while True:
        with store.transaction():
            end = conn.execute(
                "SELECT max(name), count(*) FROM"
                " (SELECT name FROM scan_rows WHERE name > ? ORDER BY name LIMIT ?)",
                (last, SCAN_BATCH),
            ).fetchone()
            if not end[1]:
                break
            conn.execute(upsert, (ns_id, last, SCAN_BATCH))
        last, done = end[0], done + end[1]
        if done % PROGRESS_EVERY < end[1]:
            log.info("reindex progress", extra={"namespace": ns_id, "rows": done})
    return _count(conn, ns_id) - before + removed, removed, diff


def _diff(conn: sqlite3.Connection, ns_id: str) -> ScanChanges | None:
    """The files of temp.scan_rows the index lacks or has at another size, and the rows it has
    of no such file."""
    new = conn.execute(
        "SELECT name, key_len, size, mtime FROM scan_rows s WHERE NOT EXISTS (SELECT 1 FROM pages"
        " p WHERE p.namespace_id = ? AND p.name = s.name AND p.size = s.size) LIMIT ?",
        (ns_id, MAX_CHANGES + 1),
    ).fetchall()
    gone = conn.execute(
        "SELECT name, key_len FROM pages WHERE namespace_id = ? AND name NOT IN"
        " (SELECT name FROM scan_rows) LIMIT ?",
        (ns_id, MAX_CHANGES + 1),
    ).fetchall()
    return None if len(new) + len(gone) > MAX_CHANGES else (new, gone)


def _count(conn: sqlite3.Connection, ns_id: str) -> int:
    row = conn.execute("SELECT files FROM namespace_stats WHERE namespace_id = ?", (ns_id,))
    found = row.fetchone()
    return int(found[0]) if found else 0


def _record_scan(conn: sqlite3.Connection, r: ScanReport, at: float) -> None:
    conn.execute(
        "INSERT INTO namespace_stats (namespace_id, temp_files, foreign_files, corrupt_files,"
        " scanned_at) VALUES (?, ?, ?, ?, ?) ON CONFLICT (namespace_id) DO UPDATE SET"
        " temp_files = excluded.temp_files, foreign_files = excluded.foreign_files,"
        " corrupt_files = excluded.corrupt_files, scanned_at = excluded.scanned_at",
        (r.namespace_id, r.temp_files, r.foreign_files, r.corrupt_files, at),
    )


def forget_namespace(store: Store, ns_id: str) -> int:
    """Drop the index rows of a namespace whose directory is gone; lifetime counters stay."""
    removed = 0
    while True:
        with store.transaction() as conn:
            n = conn.execute(
                "DELETE FROM pages WHERE namespace_id = ? AND name IN"
                " (SELECT name FROM pages WHERE namespace_id = ? LIMIT ?)",
                (ns_id, ns_id, BATCH),
            ).rowcount
        removed += n
        if n < BATCH:
            return removed


# The audit rows that mean a namespace dir went as a whole: a purge, or GC dropping an unbound
# namespace (its TTL or the keep count); other evictions take pages, not the dir.
_REMOVALS_SQL = (
    "SELECT action, reason, actor, pages, bytes FROM audit WHERE namespace_id = ?"
    " AND (action = 'purge' OR (action = 'evict' AND reason IN ('ttl', 'unbound')))"
    " ORDER BY id DESC LIMIT 1"
)


def last_removal(store: Store, ns_id: str) -> dict[str, object] | None:
    """What the audit says took the namespace's dir away, with the pages and bytes it held."""
    row = store.conn.execute(_REMOVALS_SQL, (ns_id,)).fetchone()
    if row is None:
        return None
    action, reason, actor, pages, size = row
    return {"pages": pages, "bytes": size, "removed_by": f"{action} ({reason}, {actor})"}


def scan_root(
    layout: Layout,
    store: Store,
    *,
    now: Callable[[], float] = time.time,
    scan: Callable[[str], ScanReport | None] | None = None,
    forgetting: Callable[[str], None] = lambda ns: None,
) -> list[ScanReport]:
    """Scan every namespace dir and forget index rows of namespaces that no longer exist.

    `scan` replaces scan_namespace for one namespace (the daemon's watches it first; None: not
    scanned); `forgetting` runs before a namespace's rows are forgotten (its watch is dropped).
    The index does not know the registry: a caller that may hold a lost DB registers the
    namespaces found on disk first (cachemgr.ns.registry.adopt_from_disk).
    """
    scan_one = scan or (lambda ns: scan_namespace(layout, store, ns, now=now))
    present = namespace_dirs(layout)
    reports = [r for r in map(scan_one, present) if r is not None]
    stale = {
        r[0] for r in store.conn.execute("SELECT namespace_id FROM namespace_stats WHERE pages > 0")
    } - set(present)
    for ns in sorted(stale):
        forgetting(ns)
        forget_namespace(store, ns)
    return reports
