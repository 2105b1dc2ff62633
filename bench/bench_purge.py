"""Purge of a namespace with many page files: the rename returns at once, deletion follows.

Compares against `rm -rf` of an identical tree (what operators do by hand today) in the same
run and prints the ratios. Usage: python bench/bench_purge.py [FILES] (default 200000);
BENCH_ORDER=drain-first swaps which deletion runs first, BENCH_DIR picks the filesystem.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.ns.purge import drain_trash, execute_purge, plan_purge
from cachemgr.ns.registry import ensure_namespace
from cachemgr.state.store import Store

ORDER = os.environ.get("BENCH_ORDER", "rm-first")


def fill(directory: Path, n: int) -> None:
    """n small page files named as SGLang names them."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(n):
            f = os.open(
                f"{i:064x}_Qwen-Qwen3-8B_0_1.bin", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd
            )
            os.write(f, b"p" * 64)
            os.close(f)
    finally:
        os.close(fd)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        layout = Layout.at(Path(tmp) / "root")
        create_root(layout)
        store = Store.open(layout.db_path)
        ns = "0123456789abcdef"
        ensure_namespace(layout, store, ns_id=ns, digest=ns * 2, identity={}, now=time.time())
        peer = Path(tmp) / "peer"
        t = time.perf_counter()
        fill(layout.ns_dir(ns), n)
        fill(peer, n)
        print(f"created 2 x {n:,} page files in {time.perf_counter() - t:.1f} s")

        t = time.perf_counter()
        plan = plan_purge(layout, store, namespace=ns)
        t_plan = time.perf_counter() - t
        t = time.perf_counter()
        execute_purge(plan, layout, store, actor="cli", reason="manual")
        t_rename = time.perf_counter() - t
        assert not layout.ns_dir(ns).exists() and len(os.listdir(layout.trash)) == 1

        def rm_rf() -> float:
            t = time.perf_counter()
            subprocess.run(["rm", "-rf", str(peer)], check=True)
            return time.perf_counter() - t

        def drain() -> float:
            t = time.perf_counter()
            report = drain_trash(layout, store, actor="cli")
            assert report.files == n and os.listdir(layout.trash) == []
            return time.perf_counter() - t

        # Whichever mass delete runs second is slowed by the first (FIELD_NOTES §7: minutes of
        # slow metadata work after ~600K unlinks), so the order is printed and can be swapped.
        if ORDER == "drain-first":
            t_drain, t_rm = drain(), rm_rf()
        else:
            t_rm, t_drain = rm_rf(), drain()
        store.close()

    print(f"plan (scan + count {plan.pages:,} pages): {t_plan * 1000:8.1f} ms")
    print(f"purge returns (rename into .trash/):   {t_rename * 1000:8.2f} ms")
    print(f"rm -rf of the same tree:               {t_rm * 1000:8.1f} ms")
    print(f"  -> purge returns {t_rm / t_rename:,.0f}x sooner than rm -rf")
    print(f"deletion, order {ORDER} (the second one pays for the first):")
    print(
        f"  drain_trash {n / t_drain:9,.0f} files/s   rm -rf {n / t_rm:9,.0f} files/s   "
        f"ratio drain/rm {t_rm / t_drain:.2f}"
    )


if __name__ == "__main__":
    main()
