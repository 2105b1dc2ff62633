"""bench/bench_replay.py --quick: the trace goes through SGLang's real HiCacheFile under both
evictors and the table's numbers are sane."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, SGLANG_ENV

pytestmark = pytest.mark.sglang


def rows_of(out: str) -> dict[str, dict[str, str]]:
    """The markdown table's rows by evictor, each a dict of column -> cell."""
    lines = [line for line in out.splitlines() if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(head, (c.strip() for c in line.strip("|").split("|")), strict=True))
            for line in lines[2:]]  # fmt: skip
    return {row["evictor"]: row for row in rows}


def test_quick_replay_gives_a_sane_table(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEMGR_", "SGLANG_"))}
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_replay.py"), "--quick",
         "--sglang-env", str(SGLANG_ENV), "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rows_of(proc.stdout)
    assert set(rows) == {"no cap", "sglang", "cachemgr"}
    nocap = rows["no cap"]
    pages = int(proc.stdout.split(" pages of ")[0].rsplit(" ", 1)[1])
    # with no cap nothing goes: every page of the trace is on disk and usable
    assert (int(nocap["page files at end"]), int(nocap["unusable at end"])) == (pages, 0)
    for name in ("sglang", "cachemgr"):
        row = rows[name]
        assert 0 < float(row["page hit ratio"]) <= float(nocap["page hit ratio"]) <= 1
        assert float(row["max on disk / cap"]) > 0
        assert 0 <= int(row["unusable at end"]) <= int(row["page files at end"])
    sglang, cachemgr = rows["sglang"], rows["cachemgr"]
    # SGLang's evictor reserves before it writes: sampled, its dir never goes over its cap;
    # it evicted (a cap of W/3 holds about a third of the pages)
    assert float(sglang["max on disk / cap"]) <= 1.0
    assert int(sglang["page files at end"]) < pages / 2
    delta = float(cachemgr["page hit ratio"]) - float(sglang["page hit ratio"])
    assert float(cachemgr["Δ vs SGLang"]) == pytest.approx(delta, abs=0.0015)
    assert "GC runs" in cachemgr["notes"]  # the daemon ran and answered /metrics
    assert proc.stdout.count("machine: ") == 1
