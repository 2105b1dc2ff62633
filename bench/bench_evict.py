"""Evicting N pages: GC (plan + execute, unpaced) vs `rm -rf` and `find -delete` on identical
trees, in one run; then the cost of the idle check `needs_gc` on the full index.

usage: python bench/bench_evict.py [N=500000] [rounds=1] [workdir=bench/out/evict]

The machine may be shared: with several rounds the order of the three rotates, so contention
that comes and goes (and the slowdown a mass delete leaves behind) lands on each in turn.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from cachemgr.gc.execute import execute_gc
from cachemgr.gc.plan import plan_gc
from cachemgr.gc.policy import GcPolicy
from cachemgr.gc.runner import needs_gc
from cachemgr.layout import Layout
from cachemgr.sglang.hicache import HICACHE_FILE
from cachemgr.state.store import Store

NS = "0123456789abcdef"
PAGE = b"\0" * 1024


def names(n: int) -> list[str]:
    return [f"{i:064x}_Qwen-Qwen3-8B_0_1.bin" for i in range(n)]


def make_tree(root: Path, files: list[str]) -> Path:
    d = root / "ns" / NS
    d.mkdir(parents=True)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in files:
            f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=fd)
            os.write(f, PAGE)
            os.close(f)
    finally:
        os.close(fd)
    return d


def index(layout: Layout, files: list[str]) -> Store:
    store = Store.open(layout.db_path)
    t0 = 1_000_000.0
    with store.transaction() as conn:
        conn.executemany(
            "INSERT INTO pages (namespace_id, name, size, created_at, last_access, access_seq,"
            " key_len) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                (NS, n, len(PAGE), t0, t0 + i * 0.01, i, HICACHE_FILE.key_len(n))
                for i, n in enumerate(files)
            ),
        )
    return store


def settle() -> None:
    """Flush dirty pages so one contender's writeback does not bill the next."""
    subprocess.run(["sync"], check=True)
    time.sleep(3)


def timed(label: str, fn: object, n: int) -> float:
    settle()
    t = time.perf_counter()
    fn()  # type: ignore[operator]
    secs = time.perf_counter() - t
    print(f"{label:<22} {n:>9,} files {secs:8.2f} s {n / secs:>10,.0f} files/s", flush=True)
    return n / secs


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 500_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    work = Path(sys.argv[3] if len(sys.argv) > 3 else "bench/out/evict").resolve()
    print(
        f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
        f"{platform.system()} {platform.release()}; Python {platform.python_version()}"
    )
    results: dict[str, list[float]] = {}
    for r in range(rounds):
        for label, rate in one_round(n, work, r).items():
            results.setdefault(label, []).append(rate)
    med = {label: statistics.median(rates) for label, rates in results.items()}
    for label, rate in med.items():
        print(f"median {label:<22} {rate:>10,.0f} files/s over {rounds} round(s)")
    best = max(med["find -delete"], med["rm -rf"])
    print(f"gc / faster peer = {med['gc (plan+execute)'] / best:.2f} (target >= 0.9)")


def one_round(n: int, work: Path, r: int) -> dict[str, float]:
    """Build three identical trees, index one, then time the three deleters (rotated by r)."""
    shutil.rmtree(work, ignore_errors=True)
    files = names(n)
    t = time.perf_counter()
    trees = {k: make_tree(work / k, files) for k in ("gc", "rm", "find")}
    print(f"built 3 trees of {n:,} pages in {time.perf_counter() - t:.1f} s")
    layout = Layout.at(work / "gc", state_dir=work / "state")
    store = index(layout, files)

    calls = 2000
    pol = GcPolicy(max_bytes=n * len(PAGE) * 2, min_age=0, delete_rate=None, min_free_percent=0)
    t = time.process_time()
    for _ in range(calls):
        assert needs_gc(store, layout, pol, now=time.time()) == ()
    idle = (time.process_time() - t) / calls
    t = time.process_time()
    scanned = sum(1 for e in os.scandir(trees["gc"]) if e.stat(follow_symlinks=False).st_size)
    scan = time.process_time() - t
    print(
        f"needs_gc on a {n:,}-page index: {idle * 1e6:.0f} us CPU per check; a stat scan of "
        f"the tree ({scanned:,} files): {scan:.2f} s CPU = {scan / idle:,.0f}x a check"
    )

    evict_all = GcPolicy(max_bytes=1, low_watermark=0.5, min_age=0, delete_rate=None)

    def gc() -> None:
        t = time.perf_counter()
        plan = plan_gc(store, layout, evict_all, now=time.time(), sweep=False)
        assert plan.files == n, plan.files
        print(f"  (gc plan: {time.perf_counter() - t:.2f} s)", flush=True)
        report = execute_gc(plan, store, layout, actor="bench")
        assert report.files == n, report

    contenders = {
        "find -delete": lambda: subprocess.run(
            ["find", str(trees["find"]), "-type", "f", "-delete"], check=True),
        "gc (plan+execute)": gc,
        "rm -rf": lambda: subprocess.run(["rm", "-rf", str(trees["rm"])], check=True),
    }  # fmt: skip
    order = list(contenders)
    order = order[r % 3 :] + order[: r % 3]
    print(f"round {r + 1}: load average {os.getloadavg()[0]:.2f}")
    rates = {label: timed(label, contenders[label], n) for label in order}
    store.close()
    shutil.rmtree(work, ignore_errors=True)
    return rates


if __name__ == "__main__":
    main()
