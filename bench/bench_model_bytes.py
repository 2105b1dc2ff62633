"""The chain model's bytes a page (issue 23 point 2): `ChainModel.from_index` in one process.

    .venv/bin/python bench/bench_model_bytes.py 1000000 [--runs 3] [--dir DIR]

Builds an index of `n` pages in bench_daemon.py's chain shape (2 namespaces, 64-page chains,
3 in 4 continuing the middle of the chain before; every page one file, access and birth
sequences 1..n), then, in a fresh process for each run: RSS after `gc.collect()` and
`malloc_trim(0)`, the model loaded from the index, RSS again the same way, and the bytes the
store's arrays take (`sys.getsizeof`: what each holds allocated, its spare room too); then the
model file written and read back, and a digest of the first ORDERED victims (each one's key,
names and size) of the loaded model and of the restored one: equal digests before and after a
change of the store say it evicts the same pages in the same order; and what a probe of the
key table costs after the load (FINDS keys it holds, and as many it does not). Prints a line
per run and the figures a page.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

from cachemgr.daemon import heap
from cachemgr.gc import modelfile
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.value import eviction_order
from cachemgr.state.store import Store

NS = ("00000000000000a1", "00000000000000b2")
CHAIN = 64  # pages a chain
BRANCH = 4  # of every 4 chains, 3 continue a page of the chain before
ORDERED = 100_000  # victims whose digest is printed
FINDS = 200_000  # keys looked up, of each kind


def _rows(n: int) -> list[tuple[object, ...]]:
    """(namespace, name, size, created, last_access, reads, seq, key_len, pred, born)."""
    rows: list[tuple[object, ...]] = []
    for k, ns in enumerate(NS):
        mine = range(k, n, len(NS))
        for j, i in enumerate(mine):
            c, at = divmod(j, CHAIN)
            if at:
                pred: str | None = f"{mine[j - 1]:064x}"
            elif c % BRANCH:
                pred = f"{mine[j - CHAIN // 2 - 1]:064x}"  # the middle of the chain before
            else:
                pred = None
            name = f"{i:064x}_Qwen-Qwen3-8B_0_1.bin"
            rows.append((ns, name, 1024, 1e9 + i, 1e9 + i, c % 5, i + 1, 64, pred, i + 1))
    return rows


def build(db: Path, n: int) -> None:
    """An index of `n` pages in chains."""
    store = Store.open(db)
    with store.transaction() as conn:
        conn.executemany(
            "INSERT INTO pages (namespace_id, name, size, created_at, last_access, reads,"
            " access_seq, key_len, pred, born_seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            _rows(n),
        )
    store.close()


def _rss() -> int:
    gc.collect()
    heap.trim()
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib * 1024


def _array_bytes(model: ChainModel) -> int:
    """What the store's arrays and its votes' hold allocated (not the few per-namespace dicts
    and lists)."""
    st = model.store
    fields = [*vars(st).values(), *vars(st.votes).values()]
    cols = [c for c in fields if hasattr(c, "buffer_info")]
    return sum(sys.getsizeof(c) for c in [*cols, st.leaf])


def _order_digest(model: ChainModel) -> str:
    """A digest of the first ORDERED victims of the model's order."""
    h = hashlib.sha256()
    for v in islice(eviction_order(model, before=math.inf), ORDERED):
        h.update(repr((v.namespace_id, v.key, v.names, v.size)).encode())
    return h.hexdigest()[:16]


def _find_us(model: ChainModel, n: int) -> tuple[float, float]:
    """µs a `find` takes of a key the model holds, and of one it does not."""
    find, ns = model.store.find, NS[0]
    held = [f"{i:064x}" for i in range(0, n, 2)][:FINDS]  # (NS[0] holds the even pages)
    absent = [f"{i:064x}" for i in range(n, n + FINDS)]
    out = []
    for keys in (held, absent):
        t = time.perf_counter()
        for k in keys:
            find(ns, k)
        out.append((time.perf_counter() - t) / len(keys) * 1e6)
    return out[0], out[1]


def measure(db: Path) -> dict[str, float | str]:
    """One run, in this process: load, bytes, model file."""
    store = Store.open(db)
    before = _rss()
    t = time.perf_counter()
    model = ChainModel.from_index(store.conn, NS)
    load = time.perf_counter() - t
    after = _rss()
    pages = model.store.count
    hit, miss = _find_us(model, pages)
    path = db.parent / "model.snapshot"
    t = time.perf_counter()
    modelfile.save(model, path, store, NS)
    saved = time.perf_counter() - t
    restored = ChainModel()
    t = time.perf_counter()
    back = modelfile.restore(restored, path, store)
    restore = time.perf_counter() - t
    assert back == set(NS) and restored.store.count == pages
    t = time.perf_counter()
    first = sum(1 for _ in zip(range(1000), eviction_order(model, before=math.inf), strict=False))
    order = time.perf_counter() - t
    assert first == 1000
    out: dict[str, float | str] = {
        "pages": pages,
        "load_s": load,
        "rss_b_page": (after - before) / pages,
        "arrays_b_page": _array_bytes(model) / pages,
        "file_mib": path.stat().st_size / 2**20,
        "save_s": saved,
        "restore_s": restore,
        "first_order_s": order,
        "find_hit_us": hit,
        "find_miss_us": miss,
        "order": _order_digest(model),
        "restored_order": _order_digest(restored),
    }
    path.unlink()
    store.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("n", type=int)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", default=os.environ.get("BENCH_DIR"))
    p.add_argument("--measure", help=argparse.SUPPRESS)  # (a run's own process: the DB)
    a = p.parse_args()
    if a.measure:
        print(json.dumps(measure(Path(a.measure))))
        return
    base = Path(tempfile.mkdtemp(prefix="cachemgr-model-bytes-", dir=a.dir))
    try:
        db = base / "state.db"
        t = time.perf_counter()
        build(db, a.n)
        print(f"index of {a.n:,} pages built in {time.perf_counter() - t:.1f} s")
        runs = []
        for _ in range(a.runs):
            argv = [sys.executable, __file__, str(a.n), "--measure", str(db)]
            out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
            runs.append(json.loads(out.splitlines()[-1]))
            print(" ".join(f"{k} {v}" for k, v in runs[-1].items()))
        print(
            f"{a.n:,} pages: RSS {min(r['rss_b_page'] for r in runs):.1f} B a page, arrays "
            f"{runs[0]['arrays_b_page']:.1f}; load {min(r['load_s'] for r in runs):.2f} s (min), "
            f"model file {runs[0]['file_mib']:.1f} MiB, saved {min(r['save_s'] for r in runs):.2f}"
            f" s, restored {min(r['restore_s'] for r in runs):.2f} s"
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
