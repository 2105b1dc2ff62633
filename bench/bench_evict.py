"""Evicting N pages: the real daemon's GC (plan + execute, unpaced) vs `rm -rf` and
`find -delete` on fresh identical copies of the same file set, and /metrics latency meanwhile.

usage: python bench/bench_evict.py [N=250000] [namespaces=1] [rounds=1] [workdir=bench/out/evict]
                                   [peers=rm,find] [first=0]

`peers=none` times the daemon alone (and its /metrics latency): one tree to build.

cachemgr's run: the daemon (uvicorn on a loopback port, its index thread watching the root)
starts on a root holding the N pages in `namespaces` namespace dirs, indexes them with no cap,
then its GC runner evicts them all (cap 1 byte, min_age 0, no pacing) while another process
scrapes /metrics every POLL_MS, as Prometheus would (more often). The time is the run's (plan
+ execute); the latencies are the scrapes that started during it.

The machine may be shared: with several rounds the order of the three rotates, so contention
that comes and goes (and the slowdown a mass delete leaves behind) lands on each in turn.
`first` numbers the first round, to go on rotating across runs (an A/B of two code versions
run one after the other, each with its peers).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from cachemgr.daemon.lifecycle import Daemon
from cachemgr.fs.deletion import Pacer
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.ns.registry import ensure_namespace
from cachemgr.settings import Settings
from cachemgr.state.store import Store

PAGE = b"\0" * 1024
POLL_MS = 20
IDLE_S = 3.0  # scraped before the run too: the idle daemon's latency, on the machine as it is
IDENTITY = {"model": "bench", "page_size": 64}
# A separate process, so the scraper takes none of the daemon's GIL: GET /metrics every
# POLL_MS until stdin closes, then print [(start, seconds)] as JSON.
POLLER = """
import json, sys, threading, time, httpx
url, every, out, done = sys.argv[1], float(sys.argv[2]), [], threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
with httpx.Client(timeout=30) as http:
    while not done.is_set():
        t = time.monotonic()
        http.get(url).raise_for_status()
        out.append((t, time.monotonic() - t))
        done.wait(max(0.0, every - (time.monotonic() - t)))
print(json.dumps(out))
"""


def ns_ids(k: int) -> list[str]:
    return [f"{i:016x}" for i in range(0xA0, 0xA0 + k)]


def names(n: int) -> list[str]:
    return [f"{i:064x}_Qwen-Qwen3-8B_0_1.bin" for i in range(n)]


def make_tree(root: Path, files: list[str], namespaces: list[str]) -> None:
    """root/ns/<id>/ for each namespace, the files dealt out round-robin."""
    for k, ns in enumerate(namespaces):
        d = root / "ns" / ns
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for name in files[k :: len(namespaces)]:
                f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=fd)
                os.write(f, PAGE)
                os.close(f)
        finally:
            os.close(fd)


def settle() -> None:
    """Flush dirty pages so one contender's writeback does not bill the next."""
    subprocess.run(["sync"], check=True)
    time.sleep(3)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def scrapes(lat: list[float]) -> str:
    ms = [x * 1e3 for x in lat] or [float("nan")]
    return (
        f"{len(lat)} scrapes, p50 {percentile(ms, 0.5):.1f} ms, p99 {percentile(ms, 0.99):.1f} ms,"
        f" max {max(ms):.1f} ms"
    )


class CachemgrRun:
    """The daemon on `root`, indexed and idle; `__call__` evicts everything through its GC."""

    def __init__(self, root: Path, namespaces: list[str], n: int) -> None:
        layout = Layout.at(root)
        create_root(layout)
        store = Store.open(layout.db_path)
        for ns in namespaces:  # registered as `cachemgr init` does
            ensure_namespace(
                layout, store, ns_id=ns, digest=ns * 4, identity=IDENTITY, now=time.time()
            )
        store.close()
        self.n = n
        settings = Settings(
            root=root,
            port=0,
            gc_max_bytes=None,
            gc_min_age=0,
            gc_delete_rate=None,
            gc_min_free_percent=0,
            gc_keep_unbound=len(namespaces),
            gc_unbound_ttl=None,
            reconcile_interval=0,
        )
        self.daemon = Daemon(settings)
        self.daemon.start()
        self.thread = threading.Thread(target=self.daemon.serve, name="uvicorn", daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.daemon.port}"
        t = time.perf_counter()
        while not _ready(self.url):
            time.sleep(0.1)
        print(f"  (daemon ready on {n:,} pages in {time.perf_counter() - t:.1f} s)", flush=True)
        self.latencies: list[float] = []
        self.idle: list[float] = []
        self.planning: list[float] = []  # the scrapes while the run planned
        self.deleting: list[float] = []  # and while it deleted

    def __call__(self) -> float:
        """Evict everything; returns the run's seconds (plan + execute: not the poller's
        start, the idle scrapes before the run, nor its shutdown)."""
        poller = subprocess.Popen(
            [sys.executable, "-c", POLLER, f"{self.url}/metrics", str(POLL_MS / 1000)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(1)  # the poller's imports
        idle = time.monotonic()
        time.sleep(IDLE_S)  # scrapes of the idle daemon, to compare with
        gc = self.daemon.gc
        gc.policy = dataclasses.replace(gc.policy, max_bytes=1, low_watermark=0.5)
        t0, wall = time.monotonic(), time.time()
        report = gc.run(actor="bench", sweep=False, pacer=Pacer(rate=None))
        t1 = time.monotonic()
        execute = report.finished_at - report.started_at
        print(f"  (plan {report.started_at - wall:.2f} s, execute {execute:.2f} s)", flush=True)
        out, _ = poller.communicate("", timeout=60)
        scrapes = json.loads(out)
        self.latencies = [s for t, s in scrapes if t0 <= t <= t1]
        self.idle = [s for t, s in scrapes if idle <= t < t0]
        planned = t0 + (report.started_at - wall)
        self.planning = [s for t, s in scrapes if t0 <= t < planned]
        self.deleting = [s for t, s in scrapes if planned <= t <= t1]
        assert report.files == self.n, report
        return t1 - t0

    def close(self) -> None:
        assert self.daemon.server is not None
        self.daemon.server.should_exit = True
        self.thread.join(60)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def timed(label: str, fn: Callable[[], object], n: int) -> float:
    settle()
    t = time.perf_counter()
    took = fn()
    secs = took if isinstance(took, float) else time.perf_counter() - t  # (its own timing)
    print(f"{label:<14} {n:>9,} files {secs:8.2f} s {n / secs:>10,.0f} files/s", flush=True)
    return n / secs


PEERS = {"rm": "rm -rf", "find": "find -delete"}


def one_round(
    n: int, k: int, work: Path, r: int, peers: list[str]
) -> tuple[dict[str, float], list[float]]:
    """Build identical trees, then time the deleters (order rotated by r)."""
    shutil.rmtree(work, ignore_errors=True)
    files, namespaces = names(n), ns_ids(k)
    t = time.perf_counter()
    for tree in ("cachemgr", *peers):
        make_tree(work / tree, files, namespaces)
    took = time.perf_counter() - t
    print(f"built {1 + len(peers)} trees of {n:,} pages in {k} namespace(s) in {took:.1f} s")
    cachemgr = CachemgrRun(work / "cachemgr", namespaces, n)
    contenders: dict[str, Callable[[], object]] = {
        "cachemgr": cachemgr,
        "rm -rf": lambda: subprocess.run(["rm", "-rf", str(work / "rm" / "ns")], check=True),
        "find -delete": lambda: subprocess.run(
            ["find", str(work / "find" / "ns"), "-type", "f", "-delete"], check=True
        ),
    }
    order = ["cachemgr", *(PEERS[p] for p in peers)]
    order = order[r % len(order) :] + order[: r % len(order)]
    print(f"round {r + 1}: load average {os.getloadavg()[0]:.2f}", flush=True)
    try:
        rates = {label: timed(label, contenders[label], n) for label in order}
    finally:
        cachemgr.close()
    lat = cachemgr.latencies
    print(f"  /metrics idle before:          {scrapes(cachemgr.idle)}")
    print(f"  /metrics during cachemgr's run: {scrapes(lat)}")
    print(f"    while it planned:            {scrapes(cachemgr.planning)}")
    print(f"    while it deleted:            {scrapes(cachemgr.deleting)}")
    print(f"  load average after: {os.getloadavg()[0]:.2f}", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return rates, lat


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 250_000
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    work = Path(sys.argv[4] if len(sys.argv) > 4 else "bench/out/evict").resolve()
    peers = [p for p in (sys.argv[5] if len(sys.argv) > 5 else "rm,find").split(",") if p in PEERS]
    first = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    print(
        f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
        f"{platform.system()} {platform.release()}; Python {platform.python_version()}"
    )
    results: dict[str, list[float]] = {}
    latencies: list[float] = []
    for r in range(first, first + rounds):
        rates, lat = one_round(n, k, work, r, peers)
        latencies += lat
        for label, rate in rates.items():
            results.setdefault(label, []).append(rate)
    med = {label: statistics.median(rates) for label, rates in results.items()}
    for label, rate in med.items():
        print(f"median {label:<14} {rate:>10,.0f} files/s over {rounds} round(s)")
    for peer in (PEERS[p] for p in peers):
        print(f"cachemgr / {peer} = {med['cachemgr'] / med[peer]:.2f}")
    if peers:
        best = max(med[PEERS[p]] for p in peers)
        print(f"cachemgr / faster peer = {med['cachemgr'] / best:.2f} (target >= 0.9)")
    print(f"/metrics during cachemgr's runs: {scrapes(latencies)} (target p99 <= 20 ms)")


if __name__ == "__main__":
    main()
