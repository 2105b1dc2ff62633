"""Scan and eviction over N vLLM block files in hashed subdirs (vLLM 0.33.0's fs tier layout,
docs/vllm-notes.md) vs `du -sb`, `find -delete` and `rm -rf`.

usage: python bench/bench_vllm.py scan|evict [N=1000000] [rounds=3] [workdir=bench/out/vllm]

The tree: one vLLM namespace, `<model>_<digest12>/config.json` and N files of 1 KiB at
`<model>_<digest12>_r0/<h[0:3]>/<h[3:5]>_g0/<h>.bin` (h: 64 hex digits of sha256(i)), i.e.
4,096 dirs and ~N·(1-1/e) leaf dirs at 1M — what vLLM's own file mapper makes. Each round
runs the tools in a rotated order; medians are printed with the ratio to the peer.

scan: `du -sb` of the namespace dir vs cachemgr's `scan_usage` (the C scanner walking the
nested dirs on THREADS walkers, vouching the folder by its config.json) and the same scan on
one walker; warm page cache (one `du` before the first round), one tree for all rounds.

evict: each tool on a freshly built tree (synced), deleting every block:
  * cachemgr `delete_files` of every block path (what GC's execute step calls, unpaced);
  * `find NS_DIR -name '*.bin' -delete`: the like-for-like peer (the same unlinks; the dirs
    stay, as cachemgr leaves them: vLLM makes a hashed dir, then opens a file in it);
  * `rm -rf RANK_DIR`: also removes the ~0.63·N dirs.
The ≥ 0.9× target is against `find -delete`. Point workdir at the filesystem to measure.
"""

from __future__ import annotations

import hashlib
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cachemgr.fs import dirscan
from cachemgr.fs.deletion import delete_files
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.vllm.fstier import VLLM_FS_TIER
from tests.vllmtrees import write_folder

NS = "00000000000000b1"
DATA = b"\0" * 1024


def build(layout: Layout, n: int) -> tuple[str, list[str]]:
    """A fresh root with the namespace's N blocks: its folder and the blocks' paths."""
    create_root(layout)
    d = layout.ns_dir(NS)
    d.mkdir(parents=True)
    paths: list[str] = []
    folder, _ = write_tree(d, n, DATA, paths)
    return folder, paths


def write_tree(d: Path, n: int, data: bytes, paths: list[str] | None = None) -> tuple[str, int]:
    """`n` blocks of `data` in vLLM's layout in namespace dir `d`: the folder its config.json
    vouches for, `<folder>_r0/<h[:3]>/<h[3:5]>_g0/<h>.bin` (h = sha256(i)), each block's path
    appended to `paths`. Returns the folder and the dirs made (the inodes they take)."""
    folder = write_folder(d)
    made: set[str] = set()
    for i in range(n):
        h = hashlib.sha256(i.to_bytes(8, "little")).hexdigest()
        sub = f"{folder}_r0/{h[:3]}/{h[3:5]}_g0"
        if sub not in made:
            os.makedirs(d / sub, exist_ok=True)
            made.add(sub)
        fd = os.open(d / sub / f"{h}.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, data)
        os.close(fd)
        if paths is not None:
            paths.append(f"{sub}/{h}.bin")
    return folder, len(made) + len({sub.rpartition("/")[0] for sub in made}) + 2


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def cpu() -> float:
    """CPU seconds (user + system) of this process's threads and its waited-for children."""
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall and CPU seconds of fn(): on a loaded machine the CPU time is the steadier figure."""
    t, c = time.perf_counter(), cpu()
    fn()
    return time.perf_counter() - t, cpu() - c


def rotated(tools: list[str], r: int) -> list[str]:
    return tools[r % len(tools) :] + tools[: r % len(tools)]


def table(n: int, times: dict[str, list[tuple[float, float]]], peer: str) -> None:
    print(f"| tool | median s | files/s | vs {peer} | median CPU s | CPU vs peer |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    wall = {name: statistics.median(w for w, _ in ts) for name, ts in times.items()}
    work = {name: statistics.median(c for _, c in ts) for name, ts in times.items()}
    for name in times:
        print(
            f"| {name} | {wall[name]:.2f} | {n / wall[name]:,.0f} | "
            f"{wall[peer] / wall[name]:.2f}× | {work[name]:.2f} | "
            f"{work[peer] / work[name]:.2f}× |"
        )


def line(times: dict[str, list[tuple[float, float]]], name: str) -> str:
    wall, work = times[name][-1]
    return f"{name} {wall:.2f} s ({work:.2f} s CPU)"


def scan(work: Path, n: int, rounds: int) -> None:
    layout = Layout.at(work / "root")
    t = time.perf_counter()
    build(layout, n)
    d = layout.ns_dir(NS)
    print(f"# built {n:,} blocks in {time.perf_counter() - t:.0f} s\n")
    sh("du", "-sb", str(d))  # warm the page cache

    def usage(threads: int) -> None:
        dirscan.THREADS = threads
        got = dirscan.scan_usage(layout, f"ns/{NS}", VLLM_FS_TIER)
        assert got is not None and got.pages == n, got

    walkers = dirscan.THREADS
    tools: dict[str, Callable[[], object]] = {
        "du -sb NS_DIR": lambda: sh("du", "-sb", str(d)),
        f"cachemgr scan_usage ({walkers} walkers)": lambda: usage(walkers),
        "cachemgr scan_usage (1 walker)": lambda: usage(1),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in tools}
    for r in range(rounds):
        for name in rotated(list(tools), r):
            times[name].append(timed(tools[name]))
        print(
            f"# round {r + 1}: "
            + ", ".join(line(times, k) for k in times)
            + f"; load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    print("\n## scan (warm page cache)\n")
    table(n, times, "du -sb NS_DIR")


def evict(work: Path, n: int, rounds: int) -> None:
    layout = Layout.at(work / "root")
    d = layout.ns_dir(NS)

    def cachemgr(paths: list[str]) -> None:
        got = delete_files(layout.root, f"ns/{NS}", paths, fmt=VLLM_FS_TIER)
        assert got.files == n and not got.refused, got

    tools: dict[str, Callable[[str, list[str]], object]] = {
        "find NS_DIR -name '*.bin' -delete": lambda _f, _p: sh(
            "find", str(d), "-name", "*.bin", "-delete"
        ),
        "rm -rf RANK_DIR": lambda folder, _p: sh("rm", "-rf", str(d / f"{folder}_r0")),
        "cachemgr delete_files": lambda _f, paths: cachemgr(paths),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in tools}
    for r in range(rounds):
        for name in rotated(list(tools), r):
            shutil.rmtree(layout.root, ignore_errors=True)
            t = time.perf_counter()
            folder, paths = build(layout, n)
            sh("sync")
            built = time.perf_counter() - t
            times[name].append(timed(lambda: tools[name](folder, paths)))  # noqa: B023
            left = subprocess.run(
                ["find", str(d), "-name", "*.bin", "-print", "-quit"],
                capture_output=True,
                text=True,
            ).stdout
            assert not left, f"{name} left blocks: {left}"
            print(
                f"# round {r + 1}, {line(times, name)} (tree built and synced in {built:.0f} s); "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    shutil.rmtree(layout.root, ignore_errors=True)
    print("\n## eviction of every block (a fresh tree each, unpaced)\n")
    table(n, times, "find NS_DIR -name '*.bin' -delete")


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "scan"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    work = Path(sys.argv[4] if len(sys.argv) > 4 else "bench/out/vllm").resolve()
    fs = subprocess.run(
        ["stat", "-f", "-c", "%T", str(work.parent)], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"# {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f}; {what} of {n:,} blocks on {fs}, {rounds} rounds"
    )
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        (scan if what == "scan" else evict)(work, n, rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
