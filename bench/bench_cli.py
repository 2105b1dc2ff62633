"""The operator's commands at scale (issue 23): `status`, `ls` and `doctor` on a root of N pages
in one flat SGLang namespace, with the daemon serving it (its index built) and without, each
beside a peer on the same data: `du -sb` and `find | wc -l` of the namespace dir, `sqlite3`
counting the index's rows, and the bare start of the `cachemgr` process. Wall time (median of
`--runs`) and peak RSS of each process.

Usage: python bench/bench_cli.py N_PAGES [--runs 3] [--keep] [--python PY]
The root is built under BENCH_DIR (default /dev/shm: creating a million files on the shared
virtio disk takes minutes) and removed afterwards unless --keep; a kept root is reused.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_daemon import start_daemon
from bench_scale import LAUNCH, NS, write_pages

from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.ns.registry import ensure_namespace
from cachemgr.state.store import Store

IDENTITY = {"model": "Qwen/Qwen3-8B", "page_size": 64}


def build(root: Path, n: int) -> Layout:
    """A root with `n` pages in NS, registered; reused if it is there with that many."""
    layout = Layout.at(root)
    d = layout.ns_dir(NS)
    if d.is_dir() and len(os.listdir(d)) == n:
        return layout
    create_root(layout)
    t = time.perf_counter()
    write_pages(d, n)
    with Store.open(layout.db_path) as store:
        ensure_namespace(layout, store, ns_id=NS, digest=NS * 4, identity=IDENTITY, now=time.time())
    print(f"made {n:,} pages in {time.perf_counter() - t:.0f} s")
    return layout


def run_once(argv: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Seconds, peak RSS (MiB) and stdout of one process. The RSS is GNU time's: a child of
    this process would inherit its peak (Linux keeps it across fork and exec)."""
    with tempfile.NamedTemporaryFile("r") as rss:
        timed = ["/usr/bin/time", "-f", "%M", "-o", rss.name, *argv]
        t = time.perf_counter()
        # From /: `python -m cachemgr` in a checkout imports that checkout's package.
        out = subprocess.run(timed, capture_output=True, text=True, env=env, cwd="/")
        took = time.perf_counter() - t
        kib = int(rss.read().split()[-1])
    return took, kib / 1024, out.stdout


def measure(label: str, argv: list[str], env: dict[str, str], runs: int) -> float:
    took = [run_once(argv, env) for _ in range(runs)]
    sec = statistics.median(t for t, _, _ in took)
    rss = max(r for _, r, _ in took)
    print(f"| {label} | {sec:.2f} | {rss:.0f} |", flush=True)
    return sec


def commands(layout: Layout, python: str) -> list[tuple[str, list[str]]]:
    me = [python, "-m", "cachemgr", "--root", str(layout.root)]
    return [
        ("`cachemgr version` (the process's start)", [*me, "version"]),
        ("`cachemgr status`", [*me, "status"]),
        ("`cachemgr status --json`", [*me, "status", "--json"]),
        ("`cachemgr ls`", [*me, "ls"]),
        ("`cachemgr ls --json`", [*me, "ls", "--json"]),
        ("`cachemgr doctor` (root)", [*me, "doctor"]),
        ("`cachemgr doctor --all-pages` (root)", [*me, "doctor", "--all-pages"]),
        ("`cachemgr doctor -- <sglang launch>`", [*me, "doctor", "--", *LAUNCH]),
    ]


def peers(layout: Layout) -> list[tuple[str, list[str]]]:
    d = str(layout.ns_dir(NS))
    return [
        ("`du -sb` of the namespace dir", ["du", "-sb", d]),
        ("`find <dir> | wc -l`", ["sh", "-c", f"find {d} | wc -l"]),
        (
            "`sqlite3 state.db 'SELECT count(*) FROM pages'`",
            ["sqlite3", f"file:{layout.db_path}?mode=ro", "SELECT count(*) FROM pages"],
        ),
    ]


def table(title: str, rows: list[tuple[str, list[str]]], env: dict[str, str], runs: int) -> None:
    print(f"\n### {title}\n\n| command | seconds (median of {runs}) | peak RSS MiB |")
    print("| --- | ---: | ---: |")
    for label, argv in rows:
        measure(label, argv, env, runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pages", type=int)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the root (and reuse a kept one)")
    ap.add_argument(
        "--python",
        default=sys.executable,
        help="the Python whose cachemgr the commands run (another checkout's venv: before/after)",
    )
    args = ap.parse_args()
    print(
        f"# cachemgr CLI bench — {platform.node()}, {os.cpu_count()} cores, "
        f"{platform.platform()}, load {os.getloadavg()[0]:.1f}, {args.pages:,} pages; "
        f"commands of {args.python}"
    )
    base = Path(os.environ.get("BENCH_DIR", "/dev/shm"))
    where = base / f"cachemgr-cli-{args.pages}"
    where.mkdir(parents=True, exist_ok=True)
    try:
        layout = build(where / "root", args.pages)
        env = {**os.environ, "CACHEMGR_LOG_LEVEL": "warning"}
        env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(layout.ns_dir(NS))
        proc, port, ready = start_daemon(layout, {})
        env["CACHEMGR_PORT"] = str(port)
        print(f"daemon ready in {ready:.1f} s (load {os.getloadavg()[0]:.1f})")
        try:
            table("peers (the daemon idle)", peers(layout), env, args.runs)
            table("daemon serving the root", commands(layout, args.python), env, args.runs)
        finally:
            proc.terminate()
            proc.wait(300)
        table("no daemon", commands(layout, args.python)[:5], env, args.runs)
        print(f"\nload at the end {os.getloadavg()[0]:.1f}")
    finally:
        if not args.keep:
            shutil.rmtree(where)


if __name__ == "__main__":
    main()
