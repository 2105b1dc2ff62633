"""bench/bench_scale.py at a small size: it builds its loop ext4, runs each measurement and
prints every figure RESULTS.md quotes (the big sizes run by hand)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loop mounts need root (CI is root)")


def bench(tmp_path: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEMGR_")}
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_scale.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**env, "BENCH_DIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def number(pattern: str, out: str) -> float:
    found = re.search(pattern, out)
    assert found, f"{pattern!r} not in:\n{out}"
    return float(found.group(1).replace(",", ""))


def test_dirlimit_finds_enospc_with_inodes_and_bytes_free(tmp_path: Path) -> None:
    out = bench(tmp_path, "dirlimit", "--block-size", "1024")
    entries = number(r"entries before the error: ([\d,]+)", out)
    assert 50_000 < entries < 100_000  # 67,561 when measured (bench/RESULTS.md)
    assert "No space left on device" in out


@pytest.mark.parametrize("layout", ["sglang", "vllm"])
def test_run_prints_each_figure_beside_its_peer(tmp_path: Path, layout: str) -> None:
    out = bench(tmp_path, "run", "20000", "--evict", "5000", "--layout", layout)
    du = number(r"cold du -sb: ([\d.]+) s", out)
    assert du > 0
    if layout == "sglang":  # (the launch doctor is timed on is SGLang's)
        assert number(r"doctor on it unadopted \(cold\): ([\d.]+) s", out) > 0
    else:  # vLLM's hashed dirs: a dir per 1-2 blocks
        assert number(r"\(vllm: ([\d,]+) dirs\)", out) > 10_000
    assert number(r"ready ([\d.]+) s \([\d.]+× cold du\)", out) > 0
    assert number(r"RSS (\d+) MiB steady", out) > 0
    for cmd in ("status", "ls", "doctor"):
        assert number(rf"`cachemgr {cmd}`: ([\d.]+) s", out) > 0
    assert number(r"/metrics during the first scan: (\d+) scrapes", out) > 0
    assert number(r"state DB (\d+) MiB", out) >= 0
    # The cap that evicts 5,000 (17,648) brings 20,000 pages to its low watermark, not below.
    assert number(r"evicted ([\d,]+) pages", out) == 5_000
    assert number(r"([\d,]+) left \(cap 17,648", out) == 15_000
    assert number(r"/metrics during the eviction, from ready: (\d+) scrapes", out) > 0
    assert number(r"/metrics during GC's run, from its first deletion: (\d+) scrapes", out) >= 0
    assert "the dir empty after" in out
    assert number(r"eviction / find -delete = ([\d.]+)", out) > 0
    assert number(r"([\d.]+) from its first deletion \(", out) > 0


def test_evict_prints_the_daemon_beside_find_on_the_same_tree(tmp_path: Path) -> None:
    out = bench(tmp_path, "evict", "5000", "--evict", "4000", "--unlinks")
    # The file cap takes 4,000 of the 5,000 pages, down to its low watermark.
    assert number(r"evicted ([\d,]+) pages", out) == 4_000
    assert number(r"([\d,]+) left \(low watermark 1,000\)", out) == 1_000
    assert number(r"find -delete of 5,000 pages, cold: ([\d.]+) s", out) > 0
    assert number(r"/metrics during the eviction, from ready: (\d+) scrapes", out) >= 0
    assert number(r"/metrics before its first deletion: (\d+) scrapes", out) >= 0  # (short)
    assert number(r"CPU seconds during the eviction.*'process': ([\d.]+)", out) >= 0
    assert number(r"eviction / find -delete = ([\d.]+)", out) > 0
    # GC's unlinks alone, on their own copy: the same 4,000 pages gone, beside find.
    assert number(r"GC's unlinks alone .* deleted ([\d,]+) pages", out) == 4_000
    assert number(r"GC's unlinks alone / find -delete = ([\d.]+)", out) > 0
