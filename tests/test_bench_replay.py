"""bench/bench_replay.py: generated and recorded traces go through SGLang's real HiCacheFile
under SGLang's evictor, the real daemon and no cap, and the numbers are the trace's.

bench/sim_trace.py (the recorded-trace reader both benches share) is tested here too: gzip,
Bailian's seconds, the request limit, and the vendored Mooncake files."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, SGLANG_ENV

sys.path.insert(0, str(REPO / "bench"))  # bench/ is scripts, not a package
from sim_trace import TraceError, read_trace

BENCH = REPO / "bench" / "bench_replay.py"
TRACES = REPO / "bench" / "traces"

# Two conversations sharing a system prefix (blocks 0, 1), a one-off and a re-read: chained
# ids, 300 ms apart. Request i's lookup is CHAINS[i]; the next turn carries the previous one.
CHAINS = [
    [0, 1, 2, 3],
    [0, 1, 4, 5],
    [0, 1, 2, 3, 6],
    [7, 8],
    [0, 1, 4, 5, 9, 10],
    [0, 1, 2, 3, 6, 11],
    [7, 8, 12],
    [0, 1, 4, 5, 9, 10, 13],
]
STEP_MS = 300


def mooncake_lines() -> list[dict[str, Any]]:
    return [
        {"timestamp": i * STEP_MS, "input_length": 512 * len(c), "output_length": 40, "hash_ids": c}
        for i, c in enumerate(CHAINS)
    ]


def bailian_lines() -> list[dict[str, Any]]:
    """The same requests in Alibaba Bailian's schema: timestamps in seconds, chat ids, turns."""
    conv = {0: 0, 1: 1, 2: 0, 3: 2, 4: 1, 5: 0, 6: 2, 7: 1}  # request -> conversation
    out, last = [], {}
    for i, c in enumerate(CHAINS):
        k = conv[i]
        out.append(
            {
                "chat_id": 100 + i,
                "parent_chat_id": last.get(k, -1),
                "timestamp": i * STEP_MS / 1000,
                "input_length": 512 * len(c),
                "output_length": 40,
                "type": "text",
                "turn": sum(1 for j in range(i + 1) if conv[j] == k),
                "hash_ids": c,
            }
        )
        last[k] = 100 + i
    return out


def write_lines(path: Path, lines: list[dict[str, Any]]) -> Path:
    text = "".join(json.dumps(line) + "\n" for line in lines)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def prefix_hits(chains: list[list[int]]) -> int:
    """Pages a request finds with no cap: the longest prefix of ids seen in earlier requests."""
    seen: set[int] = set()
    hits = 0
    for chain in chains:
        n = 0
        while n < len(chain) and chain[n] in seen:
            n += 1
        hits += n
        seen.update(chain)
    return hits


def test_a_gzipped_trace_reads_as_the_plain_one(tmp_path: Path) -> None:
    plain = read_trace(write_lines(tmp_path / "t.jsonl", mooncake_lines()))
    packed = read_trace(write_lines(tmp_path / "t.jsonl.gz", mooncake_lines()))
    assert packed == plain
    assert len(plain.requests) == len(CHAINS)
    assert plain.timestamps[-1] == pytest.approx((len(CHAINS) - 1) * STEP_MS / 1000)


def test_bailian_timestamps_are_seconds_and_its_fields_are_read(tmp_path: Path) -> None:
    mooncake = read_trace(write_lines(tmp_path / "m.jsonl", mooncake_lines()))
    bailian = read_trace(write_lines(tmp_path / "b.jsonl", bailian_lines()))
    assert bailian.timestamps == pytest.approx(mooncake.timestamps)  # s there, ms here
    assert (bailian.requests, bailian.parent) == (mooncake.requests, mooncake.parent)
    assert (bailian.conversations, dict(bailian.types)) == (3, {"text": len(CHAINS)})
    assert mooncake.conversations == 0


def test_the_limit_keeps_the_first_requests_and_only_their_pages(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", mooncake_lines())
    first = read_trace(path, limit=3)
    assert first.requests == read_trace(path).requests[:3]
    assert len(first.parent) == len({b for c in CHAINS[:3] for b in c})


def test_a_file_that_is_not_gzip_is_one_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "t.jsonl.gz"
    bad.write_text(json.dumps(mooncake_lines()[0]) + "\n")
    with pytest.raises(TraceError, match="not a readable trace file"):
        read_trace(bad)


@pytest.mark.parametrize(
    ("name", "requests", "pages"),
    [("conversation_trace.jsonl.gz", 12031, 182790), ("synthetic_trace.jsonl.gz", 3993, 43924)],
)
def test_the_vendored_mooncake_traces_read(name: str, requests: int, pages: int) -> None:
    """What `--trace bench/traces/...` gives from a fresh clone (the counts are those of the
    Mooncake README and of the simulator's recorded-trace table in bench/RESULTS.md)."""
    rec = read_trace(TRACES / name)
    assert (len(rec.requests), len(rec.parent), rec.relinked) == (requests, pages, 0)
    assert (TRACES / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert "3b5a594133958449a1feaf1c9e0fc1b553e34a28" in (TRACES / "NOTICE").read_text()


def run_bench(
    args: list[str], tmp_path: Path, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEMGR_", "SGLANG_"))}
    return subprocess.run(
        [sys.executable, str(BENCH), "--workdir", str(tmp_path / "work"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_a_bad_trace_is_one_line_and_a_failure(tmp_path: Path) -> None:
    fake_env = tmp_path / "env"  # the trace is refused before any worker would start
    (fake_env / "bin").mkdir(parents=True)
    (fake_env / "bin" / "python").symlink_to(sys.executable)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "hash_ids": [1, 2]}\n{"timestamp": 5}\n')
    proc = run_bench(["--trace", str(bad), "--sglang-env", str(fake_env)], tmp_path)
    assert proc.returncode != 0
    assert proc.stderr.strip() == f"bench_replay: {bad}:2: not a trace line ('hash_ids')"


def rows_of(out: str) -> dict[str, dict[str, str]]:
    """The markdown table's rows by evictor, each a dict of column -> cell."""
    lines = [line for line in out.splitlines() if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [
        dict(zip(head, (c.strip() for c in line.strip("|").split("|")), strict=True))
        for line in lines[2:]
    ]
    return {row["evictor"]: row for row in rows}


@pytest.mark.sglang
def test_quick_replay_gives_a_sane_table(tmp_path: Path) -> None:
    proc = run_bench(["--quick", "--sglang-env", str(SGLANG_ENV)], tmp_path, timeout=120)
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


SPEEDUP = 2.0


@pytest.mark.sglang
@pytest.mark.parametrize("schema", ["mooncake", "bailian"])
def test_a_recorded_trace_replays_through_hicachefile(tmp_path: Path, schema: str) -> None:
    """The hit ratios are the trace's: no cap finds exactly the pages of earlier requests'
    prefixes, every row looks up exactly the trace's blocks, and the paced rows keep the
    recorded clock (sped up), which a misread timestamp unit would break."""
    lines = mooncake_lines() if schema == "mooncake" else bailian_lines()
    trace = write_lines(tmp_path / f"{schema}.jsonl.gz", lines)
    out = tmp_path / "rows.json"
    args = ["--trace", str(trace), "--speedup", f"{SPEEDUP:g},0", "--caps", "2", "--json", str(out)]
    proc = run_bench([*args, "--sglang-env", str(SGLANG_ENV)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    runs = {(r["cfg"]["evictor"], r["cfg"]["rate"]) for r in rows}
    paced = {(ev, rate) for ev in ("sglang", "cachemgr") for rate in (SPEEDUP, 0)}
    assert runs == {("none", 0), *paced}
    blocks = sum(map(len, CHAINS))
    nocap = next(r for r in rows if r["cap"] is None)
    assert (sum(nocap["hits"]), sum(nocap["lookups"])) == (prefix_hits(CHAINS), blocks)
    assert nocap["files_end"] == len({b for c in CHAINS for b in c})  # one page file a block id
    span = (len(CHAINS) - 1) * STEP_MS / 1000
    for r in rows:
        assert sum(r["lookups"]) == blocks and r["lookups"][1] == 0  # no restart recorded
        assert 0 <= sum(r["hits"]) <= sum(nocap["hits"])
        if r["cfg"]["rate"]:  # the last request went out no sooner than span / speedup
            assert len(CHAINS) / r["rate"] >= span / SPEEDUP * 0.98
        elif r["cap"] is not None:
            assert len(CHAINS) / r["rate"] < span / SPEEDUP
        if r["cfg"]["evictor"] == "cachemgr":
            assert r["daemon"]["cachemgr_gc_runs_total"] > 0  # the daemon ran and answered
    sglang = [r for r in rows if r["cfg"]["evictor"] == "sglang"]
    assert all(r["max_bytes"] <= r["cap"] for r in sglang)  # its own cap, reserved before writes
    assert "no restart" in proc.stdout
    if schema == "bailian":
        assert f"first {len(CHAINS)} requests, 3 conversations" in proc.stdout


@pytest.mark.sglang
@pytest.mark.xfail(
    # Not strict: the replay this test runs held 0.93-0.95 x the cap in 5 of 5 runs of session
    # 14 (its base: 4 of 5), and one that held would fail the suite for an improvement.
    strict=False,
    reason="issue 21: runs are bimodal. Where the daemon keeps up, the writer goes ~100 req/s"
    " and the cache stays at 0.93-0.96 x the cap; where the writer's first burst into an empty"
    " cache overruns it before the index has measured a write rate, the overshoot gives the"
    " writer hits, it speeds up to 400-600 req/s and GC never catches up (2-5 x the cap;"
    " bench/RESULTS.md, 'Cap-keeping at full speed: all of session 14 merged')",
)
def test_the_daemon_holds_the_cap_on_recorded_traffic_at_full_speed(tmp_path: Path) -> None:
    """The issue's 'Must show': max bytes on disk <= 1.05 x cap, sampled every 25 ms, with the
    daemon as the only evictor of Mooncake's conversation trace (its first 1,500 requests,
    W/10, as fast as SGLang's class writes)."""
    out = tmp_path / "rows.json"
    trace = TRACES / "conversation_trace.jsonl.gz"
    args = ["--trace", str(trace), "--requests", "1500", "--speedup", "0", "--caps", "10"]
    args += ["--evictors", "cachemgr", "--json", str(out), "--sglang-env", str(SGLANG_ENV)]
    proc = run_bench(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [r for r in json.loads(out.read_text()) if r["cap"] is not None]
    assert row["daemon"]["cachemgr_gc_runs_total"] > 0
    assert row["max_bytes"] <= 1.05 * row["cap"]
