"""Scan and eviction over N vLLM block files in hashed subdirs (vLLM 0.33.0's fs tier layout,
docs/vllm-notes.md) vs `du -sb` and `rm -rf`.

usage: python bench/bench_vllm.py [N=1000000] [rounds=2] [workdir=bench/out/vllm] [scan-only]

The tree: one vLLM namespace, `<model>_<digest12>/config.json` and N files of 1 KiB at
`<model>_<digest12>_r0/<h[0:3]>/<h[3:5]>_g0/<h>.bin` (h: 64 hex digits of sha256(i)), i.e.
4,096 dirs and ~N·(1-1/e) leaf dirs at 1M — what vLLM's own file mapper makes.

1. scan: cachemgr's `scan_usage` (the C scanner walking the nested dirs, vouching the folder
   by its config.json) vs `du -sb` of the namespace dir, warm page cache, alternating.
2. eviction: `delete_files` of every block path (what GC's execute step calls: per dir, the
   dir opened from the root with O_NOFOLLOW per component, checked unlinks in C, unpaced) vs
   `rm -rf` of the rank dir, each on a fresh copy of the tree (made with `cp -a`).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from cachemgr.fs.deletion import delete_files
from cachemgr.fs.dirscan import PAGES, list_files, scan_usage
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.vllm.fstier import VLLM_FS_TIER
from tests.vllmtrees import write_folder

NS = "00000000000000b1"
DATA = b"\0" * 1024


def build(layout: Layout, n: int) -> tuple[Path, str]:
    d = layout.ns_dir(NS)
    d.mkdir(parents=True)
    folder = write_folder(d)
    made: set[str] = set()
    for i in range(n):
        h = hashlib.sha256(i.to_bytes(8, "little")).hexdigest()
        sub = f"{folder}_r0/{h[:3]}/{h[3:5]}_g0"
        if sub not in made:
            os.makedirs(d / sub, exist_ok=True)
            made.add(sub)
        fd = os.open(d / sub / f"{h}.bin", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, DATA)
        os.close(fd)
    return d, folder


def sh(*cmd: str) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def timed(fn: object) -> float:
    t = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    work = Path(sys.argv[3] if len(sys.argv) > 3 else "bench/out/vllm").resolve()
    shutil.rmtree(work, ignore_errors=True)
    layout = Layout.at(work / "master")
    create_root(layout)
    t = time.perf_counter()
    d, folder = build(layout, n)
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
          f"built {n:,} blocks in {time.perf_counter() - t:.0f} s")  # fmt: skip
    leaves = sum(1 for _ in (d / f"{folder}_r0").glob("*/*"))
    print(f"# {leaves:,} leaf dirs, 4,096 hash dirs\n")

    du, scan = [], []
    for _ in range(rounds):
        du.append(sh("du", "-sb", str(d)))
        usage = None

        def run() -> None:
            nonlocal usage
            usage = scan_usage(layout, f"ns/{NS}", VLLM_FS_TIER)

        scan.append(timed(run))
        assert usage is not None and usage.pages == n, usage
    print("## scan (warm page cache)\n")
    print("| tool | median s | files/s | vs du -sb |\n| --- | ---: | ---: | ---: |")
    for name, times in (("du -sb NS_DIR", du), ("cachemgr scan_usage (C, nested)", scan)):
        med = statistics.median(times)
        print(f"| {name} | {med:.2f} | {n / med:,.0f} | {statistics.median(du) / med:.2f}× |")

    if sys.argv[4:] == ["scan-only"]:
        shutil.rmtree(work, ignore_errors=True)
        return
    names = [f.name for f in list_files(layout, f"ns/{NS}", PAGES, VLLM_FS_TIER)]
    rm, gc = [], []
    for r in range(rounds):
        for who in ("rm", "gc") if r % 2 == 0 else ("gc", "rm"):
            copy = work / who
            shutil.rmtree(copy, ignore_errors=True)
            subprocess.run(["cp", "-a", str(layout.root), str(copy)], check=True)
            subprocess.run(["sync"], check=True)
            if who == "rm":
                rm.append(sh("rm", "-rf", str(copy / "ns" / NS / f"{folder}_r0")))
            else:
                report = None

                def evict(root: Path = copy) -> None:
                    nonlocal report
                    report = delete_files(root, f"ns/{NS}", names, fmt=VLLM_FS_TIER)

                gc.append(timed(evict))
                assert report is not None and report.files == n, report
            shutil.rmtree(copy, ignore_errors=True)
    print("\n## eviction of every block (fresh copy each, unpaced)\n")
    print("| tool | median s | files/s | vs rm -rf |\n| --- | ---: | ---: | ---: |")
    for name, times in (("rm -rf RANK_DIR", rm), ("cachemgr delete_files (nested)", gc)):
        med = statistics.median(times)
        print(f"| {name} | {med:.2f} | {n / med:,.0f} | {statistics.median(rm) / med:.2f}× |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
