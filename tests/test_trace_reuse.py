"""bench/trace_reuse.py: what a page's birth tells of its reuse, on a trace whose answers are
counted by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "trace_reuse.py"


def _trace(path: Path, requests: list[list[int]]) -> Path:
    lines = (json.dumps({"timestamp": i * 1000, "hash_ids": ids}) for i, ids in enumerate(requests))
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60
    )


def test_reuse_by_birth_and_the_admission_oracle(tmp_path: Path) -> None:
    # A system prompt (page 0) and documents: 1-2 read again by the 3rd request, which adds 7;
    # 3-4 and 5-6 never read again. 13 page lookups.
    trace = _trace(tmp_path / "t.jsonl", [[0, 1, 2], [0, 3, 4], [0, 1, 2, 7], [0, 5, 6]])
    done = _run(str(trace), "--caps", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "t.jsonl: 4 requests, 8 pages, 62.5% never read again"
    assert lines[1] == "P(read a 2nd time) 0.375, P(3rd | 2nd) 0.333"
    # Born behind a page read 0 times (0, 1, 2: all read again), once (3, 4 behind 0; 7
    # behind 2), 3 times (5, 6 behind 0).
    start = lines.index("P(read again) by accesses of the page it branches from:") + 1
    assert [line.split() for line in lines[start : start + 3]] == [
        ["0", "3", "pages", "1.000"],
        ["1", "3", "pages", "0.000"],
        ["3", "2", "pages", "0.000"],
    ]
    # W/2 = 4 pages. LRU stores 3 and 4, evicts 1, and then hits only page 0 in each of the
    # three later requests: 3 / 13. Not storing 3 and 4 (never read again; also refused by
    # the birth rule, being born behind a page read once) keeps 1 and 2 for the 3rd request.
    row = next(line for line in lines if line.startswith("| W/2 |"))
    assert [c.strip() for c in row.strip("|").split("|")] == [
        "W/2",
        "0.2308",
        "0.3846",
        "0.3846",
        "0 of 3",
    ]


def test_a_missing_trace_is_one_line(tmp_path: Path) -> None:
    done = _run(str(tmp_path / "none.jsonl"))
    assert done.returncode != 0
    assert done.stderr.strip().startswith("trace_reuse:") and "Traceback" not in done.stderr
