"""The statements on the page index: the `pages` table and the per-namespace aggregates its
triggers keep in `namespace_stats`. Callers own the transaction (Store.transaction); these
only run statements on the connection they are given. Full scans live in cachemgr.state.index.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Iterator

# (namespace, name, size, created_at, last_access, access_seq, key_len, pred key, born_seq)
PageRow = tuple[str, str, int, float, float, int, int, str | None, int]
ReadRow = tuple[int, float, int, str, str]  # (reads, at, access_seq, namespace, name)
PageFile = tuple[str, int, float, int, int]  # (name, size, last_access, access_seq, reads)


def _batch(rows: Iterable[tuple[object, ...]]) -> str:
    """Rows as one JSON array, for one statement over json_each: executemany steps each row
    apart, and each step lets the GIL go; with the daemon's GC and watcher threads busy, the
    index waited up to a switch interval (1 ms) to take it back, row after row (~0.4 ms a row
    where the statement itself takes ~10 us; bench/RESULTS.md). json.dumps writes a float's
    shortest exact digits, which SQLite reads back to the same double."""
    return json.dumps(list(rows))


def _fields(*names: str) -> str:
    """The columns of a `_batch` row, named."""
    return ", ".join(f"json_extract(value, '$[{i}]') AS {n}" for i, n in enumerate(names))


_DELETE = (
    "DELETE FROM pages WHERE (namespace_id, name) IN"
    f" (SELECT {_fields('ns', 'name')} FROM json_each(?))"
)
_UPSERT = (
    "INSERT INTO pages (namespace_id, name, size, created_at, last_access, access_seq,"
    " key_len, pred, born_seq) SELECT"
    f" {_fields('ns', 'name', 'size', 'created', 'at', 'seq', 'key_len', 'pred', 'born')}"
    " FROM json_each(?) WHERE true"  # ("WHERE true": an upsert's SELECT must have one)
    " ON CONFLICT (namespace_id, name) DO UPDATE"
    " SET size = excluded.size, last_access = max(last_access, excluded.last_access),"
    " access_seq = max(access_seq, excluded.access_seq),"
    " pred = coalesce(pred, excluded.pred)"
)
_SET_PREDS = (
    "UPDATE pages SET pred = r.pred"
    f" FROM (SELECT {_fields('pred', 'ns', 'name')} FROM json_each(?)) AS r"
    " WHERE pages.namespace_id = r.ns AND pages.name = r.name"
)
# Reads of one file in several rows add up, as row after row would.
_ADD_READS = (
    "UPDATE pages SET reads = reads + r.n, last_access = max(last_access, r.at),"
    " access_seq = max(access_seq, r.seq)"
    " FROM (SELECT ns, name, sum(n) AS n, max(at) AS at, max(seq) AS seq FROM"
    f" (SELECT {_fields('n', 'at', 'seq', 'ns', 'name')} FROM json_each(?))"
    " GROUP BY ns, name) AS r"
    " WHERE pages.namespace_id = r.ns AND pages.name = r.name"
)


TRUNCATE_ROWS = 100_000  # from this many rows, a namespace alone in the index is truncated


def delete_namespace_pages(conn: sqlite3.Connection, ns_id: str) -> None:
    """Forget every indexed page of a namespace (lifetime counters stay). Call inside a
    transaction.

    A row at a time, `pages_stats_delete` probes the page's other files and updates the stats
    row for each: at 2M rows 13.6 s, and at 9M (cold) 158 s, the DB's write lock held all that
    time. So the stats row is set aside meanwhile (each trigger then finds no row: 7.6 s at
    2M), and a namespace holding every row of the index (the seed's one 10M-page dir) is
    emptied with the pages triggers dropped and made again in the same transaction, which
    lets SQLite clear the table's pages without visiting its rows (1.5 s at 2M).
    """
    aside = f"{ns_id}~purging"  # no namespace id has a '~' (NS_ID_RE)
    files = file_count(conn, ns_id)
    conn.execute(
        "UPDATE namespace_stats SET namespace_id = ? WHERE namespace_id = ?", (aside, ns_id)
    )
    # (Not for a few rows: dropping a trigger makes every connection prepare its statements
    # again.)
    if files >= TRUNCATE_ROWS and _only_namespace(conn, ns_id):
        triggers = conn.execute(
            "SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'pages'"
        ).fetchall()
        for name, _ in triggers:
            conn.execute(f'DROP TRIGGER "{name}"')
        conn.execute("DELETE FROM pages")  # no WHERE, no trigger: SQLite's truncation
        for _, sql in triggers:
            conn.execute(sql)
        conn.execute("DELETE FROM model_stamp")  # what the dropped trigger would have done
    else:
        conn.execute("DELETE FROM pages WHERE namespace_id = ?", (ns_id,))
    conn.execute(
        "UPDATE namespace_stats SET namespace_id = ?, pages = 0, files = 0, bytes = 0,"
        " digest = 0 WHERE namespace_id = ?",
        (ns_id, aside),
    )


def _only_namespace(conn: sqlite3.Connection, ns_id: str) -> bool:
    """Whether every row of `pages` is this namespace's (two probes of the primary key)."""
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pages WHERE namespace_id < ?)"
        " OR EXISTS (SELECT 1 FROM pages WHERE namespace_id > ?)",
        (ns_id, ns_id),
    ).fetchone()
    return not row[0]


def namespace_usage(conn: sqlite3.Connection, ns_id: str) -> tuple[int, int]:
    """The pages and bytes the index counts in a namespace ((0, 0): none)."""
    row = conn.execute(
        "SELECT pages, bytes FROM namespace_stats WHERE namespace_id = ?", (ns_id,)
    ).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def delete_pages(conn: sqlite3.Connection, pages: Iterable[tuple[str, str]]) -> None:
    """Forget the index rows of these (namespace, name) pages."""
    conn.execute(_DELETE, (_batch(pages),))


def max_access_seq(conn: sqlite3.Connection) -> int:
    """The largest access sequence number stored (0 for an empty index)."""
    return int(conn.execute("SELECT COALESCE(MAX(access_seq), 0) FROM pages").fetchone()[0])


def upsert_pages(conn: sqlite3.Connection, rows: Iterable[PageRow]) -> None:
    """Index pages seen on disk; a known page keeps its newest access and takes the new size
    (and a chain link, if it had none)."""
    conn.execute(_UPSERT, (_batch(rows),))


def set_preds(conn: sqlite3.Connection, rows: Iterable[tuple[str | None, str, str]]) -> None:
    """Store relearned chain links: (pred key or None for none, namespace, file name), one
    row a file."""
    conn.execute(_SET_PREDS, (_batch(rows),))


# (name, key_len, size, last_access, access_seq, reads, pred, born_seq)
ChainRow = tuple[str, int, int, float, int, int, str | None, int]


def chain_rows(conn: sqlite3.Connection, ns_id: str) -> Iterator[ChainRow]:
    """What the chain model keeps of each indexed file of a namespace, streamed."""
    return conn.execute(
        "SELECT name, key_len, size, last_access, access_seq, reads, pred, born_seq"
        " FROM pages WHERE namespace_id = ?",
        (ns_id,),
    )


def file_count(conn: sqlite3.Connection, ns_id: str) -> int:
    """How many files of a namespace the index holds (its aggregate: no page scan)."""
    row = conn.execute("SELECT pages FROM namespace_stats WHERE namespace_id = ?", (ns_id,))
    return int((row.fetchone() or (0,))[0])


def add_reads(conn: sqlite3.Connection, rows: Iterable[ReadRow]) -> None:
    """Count reads of indexed pages and move their last access and sequence forward."""
    conn.execute(_ADD_READS, (_batch(rows),))


def add_lifetime(conn: sqlite3.Connection, ns: str, reads: int, writes: int, now: float) -> None:
    """Add a batch's reads/writes to the namespace's lifetime totals (both tables)."""
    last_read = now if reads else None
    last_write = now if writes else None
    conn.execute(
        "INSERT INTO namespace_stats (namespace_id, page_reads, page_writes, last_read_at,"
        " last_write_at) VALUES (?, ?, ?, ?, ?) ON CONFLICT (namespace_id) DO UPDATE SET"
        " page_reads = page_reads + excluded.page_reads,"
        " page_writes = page_writes + excluded.page_writes,"
        " last_read_at = coalesce(excluded.last_read_at, last_read_at),"
        " last_write_at = coalesce(excluded.last_write_at, last_write_at)",
        (ns, reads, writes, last_read, last_write),
    )
    conn.execute(
        # namespaces.page_reads/page_writes (migration 0001) are no longer kept: nothing read them.
        "UPDATE namespaces SET last_active_at = max(last_active_at, ?) WHERE id = ?",
        (now, ns),
    )


def namespace_stats_rows(conn: sqlite3.Connection) -> list[sqlite3.Row]:
    """Every namespace_stats row, whole (status reads them by column name)."""
    return conn.execute("SELECT * FROM namespace_stats").fetchall()


def namespace_bytes(conn: sqlite3.Connection) -> dict[str, int]:
    """Page bytes of each namespace with pages, from the index's aggregates (no page scan)."""
    return dict(conn.execute("SELECT namespace_id, bytes FROM namespace_stats WHERE pages > 0"))


def unbound_by_activity(conn: sqlite3.Connection) -> list[tuple[str, float]]:
    """(id, last activity) of each active namespace no instance is bound to, latest first.

    Activity is the later of the registry's last_active_at and the index's newest access."""
    return conn.execute(
        "SELECT n.id, MAX(n.last_active_at,"
        " COALESCE((SELECT MAX(p.last_access) FROM pages p WHERE p.namespace_id = n.id), 0))"
        " FROM namespaces n WHERE n.state = 'active'"
        " AND NOT EXISTS (SELECT 1 FROM bindings b WHERE b.namespace_id = n.id)"
        " ORDER BY 2 DESC, n.id"
    ).fetchall()


def namespaces_with_mixed_sizes(conn: sqlite3.Connection) -> list[str]:
    """Namespaces whose indexed files do not all have one size."""
    return [
        str(r[0])
        for r in conn.execute(
            "SELECT namespace_id FROM pages GROUP BY namespace_id HAVING COUNT(DISTINCT size) > 1"
        )
    ]


def namespace_files(conn: sqlite3.Connection, ns_id: str) -> Iterator[tuple[str, int, float, int]]:
    """(name, size, last_access, key_len) of every indexed file of a namespace, streamed."""
    return conn.execute(
        "SELECT name, size, last_access, key_len FROM pages WHERE namespace_id = ?", (ns_id,)
    )


# A page's files: the names that start with its key and have a key that long (a longer key may
# start the same way). char(1114111) sorts after any character a name can hold.
_FILES = (
    "SELECT name, size, last_access, access_seq, reads FROM pages WHERE namespace_id = ?1"
    " AND name >= ?2 AND name < ?2 || char(1114111) AND key_len = length(?2)"
)


def page_files(conn: sqlite3.Connection, ns_id: str, key: str) -> list[PageFile]:
    """Every indexed file of one page (`key`: cachemgr.backends)."""
    return conn.execute(_FILES, (ns_id, key)).fetchall()


def files_by_recency(
    conn: sqlite3.Connection, ns_id: str, before: float
) -> Iterator[tuple[float, int, str, int, int, int, int]]:
    """(last_access, access_seq, name, key_len, size, reads, files of its page) of each file
    of `ns_id` last used at or before `before`, least recently used first, streamed."""
    return conn.execute(
        "SELECT last_access, access_seq, name, key_len, size, reads, (SELECT count(*)"
        " FROM pages p WHERE p.namespace_id = f.namespace_id"
        " AND p.name >= substr(f.name, 1, f.key_len)"
        " AND p.name < substr(f.name, 1, f.key_len) || char(1114111) AND p.key_len = f.key_len)"
        " FROM pages f WHERE namespace_id = ? AND last_access <= ?"
        " ORDER BY last_access, access_seq",
        (ns_id, before),
    )


def take_model_stamp(conn: sqlite3.Connection) -> str | None:
    """The token of the model snapshot this index is still exactly as of (None: none, or the
    index changed since), taken away: the caller now owns the index (migration 0008)."""
    row = conn.execute("SELECT token FROM model_stamp").fetchone()
    conn.execute("DELETE FROM model_stamp")
    return str(row[0]) if row else None


def set_model_stamp(conn: sqlite3.Connection, token: str) -> None:
    """Say that a model snapshot with this token matches the index as it is now."""
    conn.execute("DELETE FROM model_stamp")
    conn.execute("INSERT INTO model_stamp (token) VALUES (?)", (token,))


def namespace_file_counts(conn: sqlite3.Connection) -> dict[str, int]:
    """Page files of each namespace with pages, from the index's aggregates (no page scan):
    files, not pages (a page of a TP>1 server is a file a rank)."""
    return dict(conn.execute("SELECT namespace_id, files FROM namespace_stats WHERE files > 0"))


def namespace_name_lengths(conn: sqlite3.Connection) -> dict[str, int]:
    """The longest page file name (bytes) each namespace's dir has held (migration 0012)."""
    return dict(conn.execute("SELECT namespace_id, name_len FROM namespace_stats"))


def namespace_other_files(conn: sqlite3.Connection) -> dict[str, int]:
    """Files of each namespace dir that are not pages (temps, foreign files), at its last
    scan: entries of its dir as pages are."""
    rows = conn.execute(
        "SELECT namespace_id, temp_files + foreign_files FROM namespace_stats"
        " WHERE temp_files + foreign_files > 0"
    )
    return dict(rows)
