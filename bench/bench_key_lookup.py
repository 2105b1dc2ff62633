"""What keeping a page's key out of the chain model would cost the index (issue 23 point 2).

    .venv/bin/python bench/bench_key_lookup.py 1000000 [--lookups 100000] [--dir DIR]

The model's 32-byte key is the largest part of its bytes a page. Without it, GC must learn a
victim's file names from the index. Two ways, on an index of `n` pages in bench_daemon.py's
chain shape (bench/bench_model_bytes.py builds it):

* `recency`: the index's own `pages_recency` (namespace, last_access, access_seq) finds the
  rows of the page's latest use, which the model knows (its `time` and `last`): no new index;
* `fp`: a key fingerprint column with an index on (namespace, fingerprint): the index grows,
  and every insert writes one more index entry.

(SQLite's planner, without ANALYZE, prefers the primary key's namespace prefix: each query
names its index.) Prints the DB's size, `lookups` random pages resolved each way (one query
each, and all in one query over a JSON list), the fingerprint index's build time and size,
and the time to insert 100,000 new pages with and without it (in copies of the same DB; keys
as SGLang's, sha256 digests: each lands at a random place of either index).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from bench_model_bytes import NS, build

from cachemgr.state.store import Store

BATCH = 100_000  # new pages inserted in the write-cost test


def _fp(name: str, key_len: int) -> int:
    """A 63-bit fingerprint of a page's key (as the model would keep it)."""
    raw = name[:key_len].encode()
    return zlib.crc32(raw) << 31 | zlib.crc32(raw[::-1]) >> 1


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _size(db: Path) -> float:
    return sum(p.stat().st_size for p in db.parent.glob(db.name + "*")) / 2**20


def _new_rows(n: int, fp: bool) -> list[tuple[object, ...]]:
    rows = []
    for i in range(n, n + BATCH):
        name = hashlib.sha256(str(i).encode()).hexdigest() + "_Qwen-Qwen3-8B_0_1.bin"
        row: tuple[object, ...] = (NS[i % 2], name, 1024, 2e9, 2e9, i + 1, 64, None, i + 1)
        rows.append((*row, _fp(name, 64)) if fp else row)
    return rows


def _insert(db: Path, n: int, fp: bool) -> float:
    """Seconds to insert BATCH new pages, 1,000 a transaction (as the daemon's batches)."""
    store = Store.open(db)
    rows = _new_rows(n, fp)
    cols = "namespace_id, name, size, created_at, last_access, access_seq, key_len, pred, born_seq"
    cols += ", key_fp" if fp else ""
    sql = f"INSERT INTO pages ({cols}) VALUES ({', '.join('?' * (10 if fp else 9))})"
    t = time.perf_counter()
    for i in range(0, len(rows), 1000):
        with store.transaction() as conn:
            conn.executemany(sql, rows[i : i + 1000])
    took = time.perf_counter() - t
    store.close()
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("n", type=int)
    p.add_argument("--lookups", type=int, default=100_000)
    p.add_argument("--dir", default=os.environ.get("BENCH_DIR"))
    a = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="cachemgr-key-lookup-", dir=a.dir))
    try:
        db = base / "state.db"
        build(db, a.n)
        store = Store.open(db)
        conn = store.conn
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        print(f"index of {a.n:,} pages: {_size(db):.0f} MiB")
        rows = conn.execute(
            "SELECT namespace_id, name, key_len, last_access, access_seq FROM pages"
        ).fetchall()
        picked = random.Random(1).sample(rows, a.lookups)
        one = (
            "SELECT name, key_len FROM pages INDEXED BY pages_recency"
            " WHERE namespace_id = ? AND last_access = ?"
            " AND access_seq = ?"
        )
        took, _ = _timed(lambda: [conn.execute(one, r[0:1] + r[3:5]).fetchall() for r in picked])
        print(f"recency: {a.lookups:,} lookups one query each {took:.2f} s")
        many = (
            "SELECT p.name, p.key_len FROM json_each(?) AS j"
            " JOIN pages AS p INDEXED BY pages_recency"
            " ON p.namespace_id = json_extract(j.value, '$[0]')"
            " AND p.last_access = json_extract(j.value, '$[1]')"
            " AND p.access_seq = json_extract(j.value, '$[2]')"
        )
        arg = json.dumps([(r[0], r[3], r[4]) for r in picked])
        took, got = _timed(lambda: conn.execute(many, (arg,)).fetchall())
        assert len(got) == a.lookups  # type: ignore[arg-type]
        print(f"recency: {a.lookups:,} lookups in one query {took:.2f} s")
        store.close()
        shutil.copy(db, base / "plain.db")
        store = Store.open(db)
        conn = store.conn
        conn.create_function("key_fp", 2, _fp, deterministic=True)

        def add_index() -> None:
            with store.transaction() as c:
                c.execute("ALTER TABLE pages ADD COLUMN key_fp INTEGER")
                c.execute("UPDATE pages SET key_fp = key_fp(name, key_len)")
                c.execute("CREATE INDEX pages_key_fp ON pages (namespace_id, key_fp)")

        took, _ = _timed(add_index)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        print(f"fp: column and index built in {took:.1f} s; index {_size(db):.0f} MiB")
        byfp = (
            "SELECT name, key_len FROM pages INDEXED BY pages_key_fp"
            " WHERE namespace_id = ? AND key_fp = ?"
        )
        took, _ = _timed(
            lambda: [conn.execute(byfp, (r[0], _fp(r[1], r[2]))).fetchall() for r in picked]
        )
        print(f"fp: {a.lookups:,} lookups one query each {took:.2f} s")
        store.close()
        for label, path, fp in (("without", base / "plain.db", False), ("with", db, True)):
            print(f"insert {BATCH:,} pages {label} the fp index: {_insert(path, a.n, fp):.2f} s")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
