"""Daemon benchmarks, each against a standard peer in the same run; prints ratios.

1. initial index scan of N page files vs `du -sb ROOT` and `find ROOT -type f | wc -l`
   (plus the walk alone, and a restart rescan over an index that already has the pages);
2. event ingestion: a tmp+rename writer in another process as fast as it can go, the live
   index keeping up (lag, overflows, drift reported);
3. `/metrics` and `/v1/status` latency (p50/p99) against `cachemgr serve` with N pages
   indexed, and the daemon's RSS;
4. (`--model N`, alone) the chain model at N pages: an index of N pages in learned chains,
   `cachemgr serve` restarted over it: ready time, RSS steady, and the time to the first
   eviction when a cap is crossed, with the model from the snapshot the last stop saved and,
   as the peer, loaded from the index (BENCH_SNAPSHOT_FIRST=0 runs the peer first);
5. (`--apply N`, alone) the index's cost per event on a replay-like stream of N stores, in
   this process: requests read a prefix of an earlier request's pages, then store a burst of
   4 pages continuing it (SGLang's HiCacheFile: ~1.4 reads a store), applied by PageEvents in
   the index's batches; the peer is the floor any index pays: one lstat and one upsert a store.

Usage: python bench/bench_daemon.py [N_PAGES] [N_EVENTS]   (defaults 200000 50000)
       python bench/bench_daemon.py --model N_PAGES
       python bench/bench_daemon.py --apply N_STORES
"""

from __future__ import annotations

import math
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from itertools import islice
from pathlib import Path

import httpx

from cachemgr.daemon import heap
from cachemgr.daemon.events import LOCAL, Event, Kind
from cachemgr.daemon.indexer import EVENT_BATCH, Indexer, IndexerConfig
from cachemgr.daemon.page_events import PageEvents
from cachemgr.fs.dirscan import scan_usage
from cachemgr.fs.root import create_root
from cachemgr.gc import modelfile
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.value import eviction_order
from cachemgr.layout import Layout
from cachemgr.state import pages_sql
from cachemgr.state.dbfile import quick_check
from cachemgr.state.index import scan_namespace, scan_root
from cachemgr.state.store import Store, connect

NS = ["0123456789abcdef", "fedcba9876543210"]
WRITER = r"""
import os, sys, time, uuid
d, n = sys.argv[1], int(sys.argv[2])
data = b"\x01" * 1024
t = time.perf_counter()
for i in range(n):
    tmp = os.path.join(d, f".{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, data)
    os.close(fd)
    os.replace(tmp, os.path.join(d, f"{i:064x}_bench-writer_0_1.bin"))
print(n / (time.perf_counter() - t))
"""


def timed(fn: object, *args: object) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn(*args)  # type: ignore[operator]
    return time.perf_counter() - t, out


def make_tree(layout: Layout, n: int) -> None:
    data = b"\x02" * 1024
    for k, ns in enumerate(NS):
        d = layout.ns_dir(ns)
        d.mkdir()
        for i in range(k, n, len(NS)):
            fd = os.open(d / f"{i:064x}_Qwen-Qwen3-8B_0_1.bin", os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, data)
            os.close(fd)


def sh(cmd: str) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, shell=True, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def bench_scan(layout: Layout, n: int) -> None:
    print(f"\n## initial scan of {n:,} page files (warm page cache: each tool run twice)")
    root = layout.root
    for _ in range(2):
        du = sh(f"du -sb {root}")
        find = sh(f"find {root} -type f | wc -l")
        walk, _ = timed(lambda: [scan_usage(layout, f"ns/{ns}") for ns in NS])
    if layout.db_path.exists():
        layout.db_path.unlink()
    store = Store.open(layout.db_path)
    first, reports = timed(scan_root, layout, store)
    again, _ = timed(scan_root, layout, store)
    # Pages come and go while the daemon is down: the digest differs, the rows are fixed.
    changed = max(1, n // 1000)
    d = layout.ns_dir(NS[0])
    for i in range(0, 2 * changed, 2):
        os.rename(d / f"{i:064x}_Qwen-Qwen3-8B_0_1.bin", d / f"{i:064x}_Qwen-Qwen3-8B_0_2.bin")
    drift, drift_reports = timed(scan_root, layout, store)
    store.close()
    assert sum(r.drift for r in drift_reports) == 2 * changed  # type: ignore[attr-defined]
    pages = sum(r.pages for r in reports)  # type: ignore[attr-defined]
    assert pages == n, (pages, n)
    rows = [
        ("du -sb ROOT", du),
        ("find ROOT -type f | wc -l", find),
        ("cachemgr scan (list + stat + classify, no DB)", walk),
        ("cachemgr first index build (empty DB)", first),
        ("cachemgr restart rescan (index present, unchanged)", again),
        (f"cachemgr restart rescan ({changed:,} pages renamed while down)", drift),
    ]
    print("| tool | seconds | files/s | speed vs du -sb |")
    print("| --- | ---: | ---: | ---: |")
    for name, sec in rows:
        shown = name.replace("|", "\\|")  # a Markdown table cell
        print(f"| {shown} | {sec:.2f} | {n / sec:,.0f} | {du / sec:.2f}× |")


def bench_events(layout: Layout, n: int) -> None:
    print(f"\n## event ingestion: {n:,} tmp+rename stores by a writer process")
    ns = "00000000000000aa"
    d = layout.ns_dir(ns)
    d.mkdir()
    store = Store.open(layout.db_path)
    ix = Indexer(layout, store, IndexerConfig(reconcile_interval=float("inf")))
    ix.start()
    ix.state.ready.wait()
    reader = connect(layout.db_path)
    t0 = time.perf_counter()
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(d), str(n)], stdout=subprocess.PIPE
    )
    max_lag = 0.0
    while writer.poll() is None:
        max_lag = max(max_lag, ix.lag())
        time.sleep(0.05)
    rate = float(writer.communicate()[0])
    writer_done = time.perf_counter() - t0
    while True:
        row = reader.execute(
            "SELECT pages FROM namespace_stats WHERE namespace_id = ?", (ns,)
        ).fetchone()
        if row and row[0] == n and not ix.watcher.queue:
            break
        max_lag = max(max_lag, ix.lag())
        time.sleep(0.01)
    caught_up = time.perf_counter() - t0
    st = ix.state
    writes = st.counters.get(ns)
    ix.stop()
    store.close()
    reader.close()
    print(f"writer: {rate:,.0f} stores/s; index caught up {caught_up - writer_done:.2f} s after it")
    print(
        f"writes counted from events: {writes.writes if writes else 0:,} of {n:,}; "
        f"overflows: {st.overflows}; pages fixed by rescans: {st.drift_pages}; "
        f"max lag {max_lag:.2f} s; indexed {n / caught_up:,.0f} pages/s end to end"
    )
    queue = Path("/proc/sys/fs/inotify/max_queued_events").read_text().strip()
    print(f"(fs.inotify.max_queued_events = {queue})")


CHAIN = 64  # pages a chain
BRANCH = 4  # of every 4 chains, 3 continue a page of the chain before (a shared prefix)


def _chain_rows(n: int) -> list[tuple[str | None, int, int, int, str, str]]:
    """(pred, access_seq, born_seq, reads, namespace, name) of make_tree's pages as chains."""
    rows = []
    for k, ns in enumerate(NS):
        mine = range(k, n, len(NS))
        for j, i in enumerate(mine):
            c, at = divmod(j, CHAIN)
            if at:
                pred = f"{mine[j - 1]:064x}"
            elif c % BRANCH:
                pred = f"{mine[j - CHAIN // 2 - 1]:064x}"  # the middle of the chain before
            else:
                pred = None
            rows.append((pred, i + 1, i + 1, c % 5, ns, f"{i:064x}_Qwen-Qwen3-8B_0_1.bin"))
    return rows


def _tails(layout: Layout, n: int) -> list[Path]:
    """The last page of every chain: the leaves, of which the first victim is one."""
    return [
        layout.ns_dir(ns) / f"{mine[j]:064x}_Qwen-Qwen3-8B_0_1.bin"
        for k, ns in enumerate(NS)
        for mine in [range(k, n, len(NS))]
        for j in range(CHAIN - 1, len(mine), CHAIN)
    ]


def status_kib(pid: int, field: str) -> int:
    line = next(
        line
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith(field)
    )
    return int(line.split()[1])


def serve_argv(layout: Layout, port: int, level: str = "warning") -> list[str]:
    """`cachemgr serve` of this root on a loopback port, logging `level` and worse."""
    root = ["--root", str(layout.root), "--log-level", level]
    return [sys.executable, "-m", "cachemgr", *root, "serve", "--port", str(port)]


def start_daemon(layout: Layout, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int, float]:
    """`cachemgr serve` on a free port; returns it, the port and how long it took to be ready."""
    port = free_port()
    proc = subprocess.Popen(
        serve_argv(layout, port),
        stderr=subprocess.DEVNULL,
        env={**os.environ, **env},
    )
    t0 = time.perf_counter()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"cachemgr serve exited with {proc.returncode}")
            try:
                if client.get("/readyz").status_code == 200:
                    return proc, port, time.perf_counter() - t0
            except httpx.TransportError:
                pass
            time.sleep(0.02)


def bench_model(layout: Layout, n: int) -> None:
    print(f"\n## the chain model at {n:,} pages: restarts of `cachemgr serve`")
    index_chains(layout, n)
    start_breakdown(layout)
    restarts(layout, n)


def start_breakdown(layout: Layout) -> None:
    """What a start does, step by step, in this process: the checks and scans a start runs,
    then the model loaded from the index against the model file, and the first order of each."""
    print("where a start's time goes (in-process):")
    took, _ = timed(
        lambda: subprocess.run(
            [sys.executable, "-c", "import cachemgr.cli.main, cachemgr.daemon.lifecycle"],
            check=True,
        )
    )
    print(f"  python + the daemon's imports: {took:.2f} s")
    store = Store.open(layout.db_path)
    took, _ = timed(quick_check, store.conn)
    print(f"  PRAGMA quick_check (once at start): {took:.2f} s")
    model = ChainModel()
    for ns in NS:
        took, report = timed(lambda ns=ns: scan_namespace(layout, store, ns))
        load, _ = timed(model.load, store.conn, ns)
        print(f"  {ns}: scan {took:.2f} s (drift {report.drift}), load from the index {load:.2f} s")
    first = first_order(model)
    path = layout.state_dir / "bench-model.snapshot"
    took, _ = timed(modelfile.save, model, path, store, NS)
    restored = ChainModel()
    back, _ = timed(modelfile.restore, restored, path, store)
    print(
        f"  model file: saved in {took:.2f} s ({path.stat().st_size / 2**20:.0f} MiB), "
        f"restored in {back:.2f} s"
    )
    print(
        f"  first order (1,000 victims): {first:.2f} s after a load from the index, "
        f"{first_order(restored):.2f} s after a restore; "
        f"the next one {first_order(restored):.2f} s"
    )
    path.unlink()
    store.close()


def first_order(model: ChainModel) -> float:
    took, _ = timed(lambda: list(islice(eviction_order(model, before=math.inf), 1000)))
    return took


def index_chains(layout: Layout, n: int) -> None:
    """Index make_tree's pages, then give them chains as the daemon would have learned."""
    store = Store.open(layout.db_path)
    took, _ = timed(lambda: scan_root(layout, store))
    rows = _chain_rows(n)
    with store.transaction() as conn:
        conn.executemany(
            "UPDATE pages SET pred = ?, access_seq = ?, born_seq = ?, reads = ?"
            " WHERE namespace_id = ? AND name = ?",
            rows,
        )
    del rows
    store.close()
    print(f"index built in {took:.1f} s; chains of {CHAIN} pages, 3 in 4 branching off another")


def restarts(layout: Layout, n: int) -> None:
    """Restarts over make_tree's `n` pages in chains: the first loads the model from the index
    (no snapshot yet: as every start did before snapshots), the next from the snapshot its
    stop saved; then with a cap a little under the usage (about 1.5% of the pages go: down to
    the low watermark), from a snapshot and, as the peer, with it deleted (loaded from the
    index), in rotating order."""
    for label in ("model loaded from the index", "model from the snapshot"):
        proc, _, ready = start_daemon(layout, {})
        try:
            time.sleep(10)  # GC's first cycle (nothing over a limit) and the index settle
            rss, hwm = status_kib(proc.pid, "VmRSS"), status_kib(proc.pid, "VmHWM")
        finally:
            stop(proc, layout)
        print(
            f"restart, no cap, {label}: ready {ready:.2f} s; RSS {rss / 1024:.0f} MiB steady "
            f"(peak {hwm / 1024:.0f} MiB)"
        )
    runs = [True, False] if os.environ.get("BENCH_SNAPSHOT_FIRST", "1") == "1" else [False, True]
    for snapshot in runs:
        if not snapshot:
            layout.model_snapshot.unlink()  # (its stamp in the index is then of no file)
        label = "model from the snapshot" if snapshot else "model loaded from the index"
        capped_restart(layout, n, label)


def stop(proc: subprocess.Popen[bytes], layout: Layout) -> None:
    """SIGTERM, as systemd or kubelet stop it: the daemon saves its model on the way out."""
    t = time.perf_counter()
    proc.terminate()
    proc.wait(60)
    print(
        f"  (stopped in {time.perf_counter() - t:.2f} s; snapshot "
        f"{layout.model_snapshot.stat().st_size / 2**20:.0f} MiB)"
    )


def capped_restart(layout: Layout, n: int, label: str) -> None:
    """A restart over a cap of usage / 0.955: ready, first page evicted, RSS after that."""
    tails = [t for t in _tails(layout, n) if t.exists()]
    with Store.open(layout.db_path) as store:
        used = sum(pages_sql.namespace_bytes(store.conn).values())
    cap = {
        "CACHEMGR_GC_MAX_BYTES": str(int(used / 0.955)),
        "CACHEMGR_GC_MIN_AGE": "0s",
        "CACHEMGR_GC_HIGH_WATERMARK": "0.95",
        "CACHEMGR_GC_LOW_WATERMARK": "0.94",
    }
    t0 = time.perf_counter()
    proc, _, ready = start_daemon(layout, cap)
    try:
        while all(t.exists() for t in tails):
            time.sleep(0.02)
        first = time.perf_counter() - t0
        rss_first = status_kib(proc.pid, "VmRSS")
        time.sleep(10)
        rss, hwm = status_kib(proc.pid, "VmRSS"), status_kib(proc.pid, "VmHWM")
    finally:
        stop(proc, layout)
    print(
        f"restart over a cap of usage / 0.955, {label}: ready {ready:.2f} s, first page "
        f"evicted {first:.2f} s after start; RSS {rss_first / 1024:.0f} MiB right after it, "
        f"{rss / 1024:.0f} MiB 10 s later (peak {hwm / 1024:.0f} MiB)"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bench_http(layout: Layout, n: int, requests: int = 400) -> None:
    print(f"\n## HTTP latency against `cachemgr serve` with {n:,} pages indexed")
    proc, port, took = start_daemon(layout, {})
    try:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
        totals = client.get("/v1/status").json()["totals"]
        assert totals["pages"] == n, totals  # the rebuilt index agrees with the disk
        print(
            f"ready {took:.2f} s after start (a restart: the index is already there); "
            f"pages {totals['pages']:,} = files on disk"
        )
        for path in ("/metrics", "/v1/status"):
            lat = []
            for _ in range(requests):
                t = time.perf_counter()
                client.get(path).raise_for_status()
                lat.append((time.perf_counter() - t) * 1000)
            q = statistics.quantiles(lat, n=100)
            print(f"{path}: p50 {q[49]:.1f} ms, p99 {q[98]:.1f} ms ({requests} requests)")
        rss, hwm = status_kib(proc.pid, "VmRSS"), status_kib(proc.pid, "VmHWM")
        print(f"daemon RSS {rss / 1024:.0f} MiB (peak {hwm / 1024:.0f} MiB)")
        client.close()
    finally:
        proc.terminate()
        proc.wait(30)


BURST = 4  # pages a request stores after its read prefix
PREFIX_MAX = 13  # pages a request reads at most (uniform 0-13): ~1.4 reads a store
RUNS = 3


def replay_stream(d: Path, ns: str, stores: int) -> list[Event]:
    """A replay's page events, its stores' files made (2 KiB): each request reads a prefix of
    one of the last 256 requests' chains, then stores 4 pages continuing it."""
    rng = random.Random(21)
    data = b"\x03" * 2048
    chains: list[list[str]] = [[]]
    events: list[Event] = []
    for _ in range(stores // BURST):
        prefix = rng.choice(chains)[: rng.randint(0, PREFIX_MAX)]
        burst = [f"{rng.getrandbits(256):064x}_Qwen-Qwen3-8B_0_1.bin" for _ in range(BURST)]
        for name in burst:
            fd = os.open(d / name, os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, data)
            os.close(fd)
        events += [(Kind.READ, ns, n, 0.0, LOCAL) for n in prefix]
        events += [(Kind.WRITE, ns, n, 0.0, LOCAL) for n in burst]
        chains.append(prefix + burst)
        del chains[:-256]
    return events


def apply_index(layout: Layout, db: Path, events: list[Event]) -> float:
    """Seconds PageEvents takes to apply `events` in the index's batches, on a fresh DB."""
    with Store.open(db) as store:
        pages = PageEvents(layout, store)
        t = time.perf_counter()
        for i in range(0, len(events), EVENT_BATCH):
            pages.apply(events[i : i + EVENT_BATCH], now=time.time())
        return time.perf_counter() - t


def apply_floor(layout: Layout, db: Path, events: list[Event]) -> float:
    """Seconds the floor takes on the same batches: an lstat and an upsert a store."""
    root = str(layout.ns_root)
    with Store.open(db) as store:
        t = time.perf_counter()
        for i in range(0, len(events), EVENT_BATCH):
            now, rows = time.time(), list[pages_sql.PageRow]()
            for seq, (kind, ns, name, _, _) in enumerate(events[i : i + EVENT_BATCH], i):
                if kind is Kind.WRITE:
                    st = os.stat(os.path.join(root, ns, name), follow_symlinks=False)
                    rows.append((ns, name, st.st_size, now, now, seq, 64, None, seq))
            with store.transaction() as conn:
                pages_sql.upsert_pages(conn, rows)
        return time.perf_counter() - t


class Busy:
    """A thread running Python as long as it may, as the daemon's GC and watcher do at full
    speed: each time the index gives the GIL up (a syscall, an SQLite step) it may wait a
    switch interval (the daemon's, cachemgr.daemon.heap) to take it back."""

    def __enter__(self) -> Busy:
        self.stop, self.interval = False, sys.getswitchinterval()
        sys.setswitchinterval(heap.SWITCH_INTERVAL)
        self.thread = threading.Thread(target=self._spin)
        self.thread.start()
        return self

    def _spin(self) -> None:
        while not self.stop:
            pass

    def __exit__(self, *_: object) -> None:
        self.stop = True
        self.thread.join()
        sys.setswitchinterval(self.interval)


def bench_apply(layout: Layout, stores: int) -> None:
    ns = "00000000000000aa"
    d = layout.ns_dir(ns)
    d.mkdir()
    events = replay_stream(d, ns, stores)
    reads = len(events) - stores
    print(
        f"\n## the index's cost per event: {stores:,} stores in bursts of {BURST}, "
        f"{reads:,} reads ({reads / stores:.2f} a store), batches of {EVENT_BATCH:,}"
    )
    print(
        "| run | load | PageEvents.apply µs/event | floor: lstat + upsert a store | "
        "apply, a busy thread beside | floor, a busy thread beside |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    us = 1e6 / len(events)
    for run in range(RUNS):
        load = os.getloadavg()[0]
        own = apply_index(layout, layout.state_dir / f"apply-{run}.db", events)
        floor = apply_floor(layout, layout.state_dir / f"floor-{run}.db", events)
        with Busy():
            own_busy = apply_index(layout, layout.state_dir / f"apply-busy-{run}.db", events)
            floor_busy = apply_floor(layout, layout.state_dir / f"floor-busy-{run}.db", events)
        print(
            f"| {run + 1} | {load:.2f} | {own * us:.1f} | {floor * us:.1f} | "
            f"{own_busy * us:.1f} | {floor_busy * us:.1f} |"
        )


def main() -> None:
    model = sys.argv[1:2] == ["--model"]
    apply = sys.argv[1:2] == ["--apply"]
    args = sys.argv[2:] if model or apply else sys.argv[1:]
    n = int(args[0]) if args else 200_000
    events = int(args[1]) if len(args) > 1 else 50_000
    print(
        f"# cachemgr daemon bench — {platform.node()}, {os.cpu_count()} cores, "
        f"{platform.platform()}, Python {platform.python_version()}"
    )
    base = Path(tempfile.mkdtemp(prefix="cachemgr-bench-", dir=os.environ.get("BENCH_DIR")))
    try:
        layout = Layout.at(base / "root")
        create_root(layout)
        if apply:
            bench_apply(layout, n)
            return
        t, _ = timed(make_tree, layout, n)
        print(f"made {n:,} page files in {t:.1f} s ({n / t:,.0f}/s)")
        if model:
            bench_model(layout, n)
            return
        bench_scan(layout, n)
        bench_http(layout, n)
        bench_events(layout, events)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
