"""Replay through SGLang's HiCacheFile (issues #13 and #21): SGLang's evictor against cachemgr's.

A trace goes through SGLang's real `HiCacheFile` (bench/replay_worker.py, in the .sglang-env),
served as SGLang serves it: the longest contiguous prefix on disk is looked up
(`batch_exists`) and loaded (`batch_get`), MIN over the TP ranks as SGLang all-reduces it, and
the rest written through (`batch_set`). Each TP rank has its own `HiCacheFile` and file suffix.
Pages are small (`--page-bytes`) so the bytes written with no cap, W, are tens of MB. Two
evictors on the same trace:

* `sglang`: SGLang's own `LRUFileEvictor`, `SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE` = cap / TP per
  rank (its cap is per rank), its default `eviction_ratio` (0.9). At the restart a fresh
  `HiCacheFile` seeds its LRU from the directory by mtime.
* `cachemgr`: no SGLang cap; the real daemon (`cachemgr serve`, a subprocess on a loopback
  port) on a root whose namespace dir HiCacheFile writes to, with `gc_max_bytes` = cap,
  watermarks 1.0 → 0.9, `gc_min_age` 0, deletes unpaced (a rate of 1e9/s: the setting has no
  "off" value), a short `gc_interval`; `--daemon-env KEY=VALUE` adds or overrides settings.
  At the restart the daemon is restarted too (SIGTERM, start again).

Two kinds of trace:

* generated (the default): the simulator's (bench/sim_policy.py `make_trace`: Zipf sessions,
  a shared system prefix, histories that grow and reset, a server restart halfway), paced at
  `--rates` requests/s;
* recorded (`--trace FILE`): Mooncake's JSON lines or Alibaba Bailian's schema, read by
  bench/sim_trace.py (`.gz` too). Each 512-token block id is one page, each request's
  `hash_ids` the chain it looks up; only the prompt's blocks are written (the recorded next
  turn already carries the output). `--requests N` keeps the first N. The clock follows the
  recorded timestamps, sped up by each `--speedup` factor (0: full speed). No restart (none is
  recorded). Mooncake's conversation and synthetic traces are in bench/traces/.

Per row: page hit ratio (pages loaded / pages looked up; also after the restart alone), the
most page bytes ever on disk / cap (a sampler sums page file sizes every `--sample-ms` over the
whole run) and the least once they first reached 0.9 x cap (over-eviction), page files on disk
at the end that no request can load (a page before them in their chain, or their page on
another rank, is missing), and for cachemgr the difference to SGLang's hit ratio. Caps are
fractions of W, measured by an uncapped run of the same trace first. With `--workdir` each
run's root, logs (the daemon's too) and `samples.csv` (bytes on disk over time) are kept.

Paced runs (`--rates` requests/s, or `--speedup` > 0; 0 = as fast as SGLang's class goes) run
concurrently (`--jobs`), each on its own root and port; a generated trace's paced runs use a
smaller trace (`--paced-sessions`, `--paced-requests`). Full-speed runs go one at a time
(`--full-jobs`) so they do not share the CPU.

    .venv/bin/python bench/bench_replay.py            # the matrix: caps W/3, W/2; ~2 req/s and
                                                      # full speed; TP 1 and 2 (15-20 min on a
                                                      # shared 2-core VM at load 5-20)
    .venv/bin/python bench/bench_replay.py --quick    # one small configuration (25-40 s)
    .venv/bin/python bench/bench_replay.py --shape pressured   # issue #13's trace shape
    .venv/bin/python bench/bench_replay.py --trace bench/traces/conversation_trace.jsonl.gz \
        --requests 4000 --speedup 10,0 --caps 10,5 --tp 1    # Mooncake's recorded traffic

`--repeat N` runs each capped row N times; `--hogs N` keeps N CPU-bound processes running
(`python -c 'while 1: pass'`) for the whole matrix, to see the cap under CPU competition.

The .sglang-env is `$CACHEMGR_SGLANG_ENV` or ./.sglang-env (`--sglang-env`; `make sglang-env`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from replay_harness import CPU, DIED, LOW, NS, DaemonProc, Sampler, daemon_env, make_root
from sim_policy import SHAPES, Trace, make_trace
from sim_trace import Recorded, TraceError, read_trace

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "bench" / "replay_worker.py"


@dataclass(frozen=True)
class Config:
    trace: str  # "full", "paced" (generated) or "recorded": which trace
    rate: float  # the trace clock's speed (generated: requests/s); 0: as fast as it goes
    tp: int
    cap_div: int | None  # the cap is W / cap_div; None: no cap
    evictor: str  # "sglang", "cachemgr" or "none"
    rep: int = 0  # which of `--repeat` runs

    @property
    def name(self) -> str:
        cap = f"w{self.cap_div}" if self.cap_div else "nocap"
        again = f"-{self.rep}" if self.rep else ""
        return f"{self.trace}-r{self.rate:g}-tp{self.tp}-{cap}-{self.evictor}{again}"

    @property
    def lane(self) -> str:
        """ "full": runs one at a time, sampled often; "paced": runs side by side."""
        return "full" if self.rate == 0 else "paced"


@dataclass(frozen=True)
class Row:
    cfg: Config
    cap: int | None
    hits: list[int]  # before / after the restart
    lookups: list[int]
    max_bytes: int
    end_bytes: int
    files_end: int
    unusable_end: int
    rate: float  # requests/s achieved
    races: int
    set_failures: int
    sample_s: float  # mean time between samples
    min_full: int | None  # least bytes on disk once they first reached the low watermark
    daemon: dict[str, float]  # daemon counters summed over its two lives

    @property
    def ratio(self) -> float:
        return sum(self.hits) / sum(self.lookups)

    @property
    def ratio_after(self) -> float:
        return self.hits[1] / self.lookups[1] if self.lookups[1] else 0.0


def worker_env(cfg: Config, cap: int | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEMGR_", "SGLANG_"))}
    env["OMP_NUM_THREADS"] = "1"  # a 2-core machine: torch's thread pool only contends
    if cfg.evictor == "sglang" and cap is not None:
        env["SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"] = str(cap // cfg.tp)
    return env


@dataclass(frozen=True)
class Bench:
    """What every run shares: where things are and how to run them."""

    work: Path
    sglang_python: Path
    traces: dict[str, Path]
    page_bytes: int
    sample_s: dict[str, float]  # by trace
    daemon_extra: tuple[str, ...]

    def run(self, cfg: Config, cap: int | None) -> Row:
        run_dir = self.work / cfg.name
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        layout = make_root(run_dir / "root")
        job = run_dir / "job.json"
        job.write_text(
            json.dumps(
                {
                    "trace": str(self.traces[cfg.trace]),
                    "dir": str(layout.ns_dir(NS)),
                    "tp": cfg.tp,
                    "rate": cfg.rate,
                    "page_bytes": self.page_bytes,
                }
            )
        )
        with open(run_dir / "log.txt", "w") as log:
            daemon = None
            if cfg.evictor == "cachemgr":
                assert cap is not None
                daemon = DaemonProc(layout, daemon_env(layout, cap, self.daemon_extra), log)
                daemon.start()
            # full = the low watermark: what both evictors evict down to (the cap at most)
            full = int((cap or 0) * LOW) or sys.maxsize
            sampler = Sampler(layout, self.page_bytes, self.sample_s[cfg.lane], full)
            sampler.start()
            try:
                result = self._replay(job, worker_env(cfg, cap), log, daemon, sampler)
            finally:
                sampler.stop()
                sampler.write(run_dir / "samples.csv")
                if daemon is not None and daemon.proc is not None:
                    daemon.stop()
        return Row(
            cfg=cfg,
            cap=cap,
            hits=result["hits"],
            lookups=result["lookups"],
            max_bytes=sampler.max_bytes,
            end_bytes=sampler.last_bytes,
            files_end=result["files_end"],
            unusable_end=result["unusable_end"],
            rate=result["requests"] / result["elapsed"],
            races=result["races"],
            set_failures=result["set_failures"],
            sample_s=sampler.mean_interval,
            min_full=sampler.min_full,
            daemon=daemon.counters if daemon else {},
        )

    def _replay(
        self,
        job: Path,
        env: dict[str, str],
        log: IO[str],
        daemon: DaemonProc | None,
        sampler: Sampler,
    ) -> dict[str, Any]:
        proc = subprocess.Popen(
            [str(self.sglang_python), str(WORKER), str(job)],
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            for line in proc.stdout:
                msg = json.loads(line)
                if "restart" in msg:
                    sampler.mark("server stopped")
                    if daemon is not None:  # the server and its sidecar restart together
                        daemon.stop()
                        daemon.start()
                    sampler.mark("server starts again")
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                elif "result" in msg:
                    return dict(msg["result"])
            raise RuntimeError(f"replay worker exited with {proc.wait()}; see {log.name}")
        finally:
            proc.stdin.close()
            proc.stdout.close()
            if proc.wait(60) != 0:
                raise RuntimeError(f"replay worker failed; see {log.name}")


def write_trace(trace: Trace, path: Path) -> None:
    """A generated trace for the worker: its requests 1 s apart on the trace's clock."""
    path.write_text(
        json.dumps(
            {
                "parent": trace.parent,
                "requests": trace.requests,
                "restart_at": trace.restart_at,
                "times": list(range(len(trace.requests))),
            }
        )
    )


def write_recorded(rec: Recorded, path: Path) -> None:
    """A recorded trace for the worker: its own arrival times, and no restart."""
    path.write_text(
        json.dumps(
            {
                "parent": rec.parent,
                "requests": rec.requests,
                "restart_at": len(rec.requests),
                "times": rec.timestamps,
            }
        )
    )


def trace_name(args: argparse.Namespace, rate: float) -> str:
    if args.trace is not None:
        return "recorded"
    return "full" if rate == 0 else "paced"


def run_matrix(bench: Bench, args: argparse.Namespace) -> list[Row]:
    """Each trace uncapped first (W, for each TP size), one at a time at full speed: with no
    cap the rate changes nothing. Then two lanes at once: paced runs concurrently (`--jobs`,
    they mostly wait), full-speed runs one at a time (`--full-jobs`) so they do not share the
    CPU."""
    configs = [
        Config(trace_name(args, rate), rate, tp, div, ev, rep)
        for rate in args.rates
        for tp in args.tp
        for div in args.caps
        for ev in args.evictors
        for rep in range(args.repeat)
    ]
    uncapped = sorted({(c.trace, c.tp) for c in configs})
    rows = [bench.run(Config(trace, 0, tp, None, "none"), None) for trace, tp in uncapped]
    w = {(r.cfg.trace, r.cfg.tp): r.end_bytes for r in rows}
    jobs = {"paced": args.jobs, "full": args.full_jobs}

    def lane(name: str) -> list[Row]:
        todo = [c for c in configs if c.lane == name]
        with ThreadPoolExecutor(max(1, jobs[name])) as pool:
            return list(
                pool.map(lambda c: bench.run(c, w[c.trace, c.tp] // (c.cap_div or 1)), todo)
            )

    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lane, sorted({c.lane for c in configs})))
    return rows + [row for lane_rows in done for row in lane_rows]


EVICTORS = ("none", "sglang", "cachemgr")


def order(r: Row) -> tuple[Any, ...]:
    """Each trace's uncapped runs first, then by rate (full speed last), TP, cap (tightest
    first), evictor, repeat."""
    c = r.cfg
    return (
        c.trace == "full",
        (c.rate or float("inf")) if r.cap else -1,
        c.tp,
        -(c.cap_div or 0),
        EVICTORS.index(c.evictor),
        c.rep,
    )


def pace(r: Row) -> str:
    """The pace column: the trace for an uncapped row, else its clock."""
    if r.cap is None:
        return f"({r.cfg.trace} trace)"
    if r.cfg.rate == 0:
        return "full"
    return f"×{r.cfg.rate:g} clock" if r.cfg.trace == "recorded" else f"~{r.cfg.rate:g} req/s"


def table(rows: list[Row]) -> str:
    lines = [
        "| pace | TP | cap | evictor | page hit ratio | after restart | Δ vs SGLang |"
        " max on disk / cap | min once full | unusable at end | page files at end |"
        " achieved req/s | notes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = {
        (r.cfg.rate, r.cfg.tp, r.cfg.cap_div): r.ratio for r in rows if r.cfg.evictor == "sglang"
    }
    for r in sorted(rows, key=order):
        c = r.cfg
        cap = "none" if r.cap is None else f"W/{c.cap_div} ({r.cap / 1e6:.1f} MB)"
        after = f"{r.ratio_after:.3f}" if r.lookups[1] else ""
        key = (c.rate, c.tp, c.cap_div)
        delta = f"{r.ratio - base[key]:+.3f}" if c.evictor == "cachemgr" and key in base else ""
        fill = f"{r.max_bytes / r.cap:.2f}" if r.cap else f"W = {r.end_bytes / 1e6:.1f} MB"
        least = f"{r.min_full / r.cap:.2f}" if r.cap and r.min_full is not None else ""
        notes = [f"sampled every {r.sample_s * 1000:.0f} ms"]
        if r.races:
            notes.append(f"{r.races} pages gone between exists and get")
        if r.set_failures:
            notes.append(f"{r.set_failures} failed batch_set")
        if r.daemon:
            notes.append(
                f"daemon: {r.daemon.get('cachemgr_gc_runs_total', 0):.0f} GC runs,"
                f" {r.daemon.get('cachemgr_evicted_pages_total', 0):.0f} pages evicted,"
                f" {r.daemon.get(CPU, 0):.1f} CPU s"
            )
        if r.daemon.get(DIED):
            notes.append(f"**the daemon died {r.daemon[DIED]:.0f}x** (see its log)")
        overflows = r.daemon.get("cachemgr_watcher_overflows_total")
        if overflows:
            notes.append(f"{overflows:.0f} inotify overflows")
        lines.append(
            f"| {pace(r)} | {c.tp} | {cap} | {c.evictor if r.cap else 'no cap'} | {r.ratio:.3f} |"
            f" {after} | {delta} | {fill} | {least} | {r.unusable_end} |"
            f" {r.files_end} | {r.rate:.1f} | {'; '.join(notes)} |"
        )
    return "\n".join(lines)


def machine_line(sglang_python: Path, load0: float, hogs: int) -> str:
    queue = Path("/proc/sys/fs/inotify/max_queued_events")
    sglang = sorted(
        sglang_python.parent.parent.glob("lib/python*/site-packages/sglang-*.dist-info")
    )
    version = sglang[0].name.removesuffix(".dist-info").split("-")[1] if sglang else "?"
    return (
        f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus,"
        f" {platform.system()} {platform.release()}; Python {platform.python_version()};"
        f" SGLang {version}; load average {load0:.2f} -> {os.getloadavg()[0]:.2f};"
        f" fs.inotify.max_queued_events {queue.read_text().strip() if queue.exists() else '?'};"
        f" {hogs} CPU-bound processes competing (--hogs)"
    )


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one small configuration (< 60 s)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="default", help="trace shape")
    ap.add_argument(
        "--trace", type=Path, help="a recorded trace (Mooncake / Bailian JSON lines, or .gz)"
    )
    ap.add_argument("--sessions", type=int, help="full-speed trace (default: the shape's)")
    ap.add_argument(
        "--requests",
        type=int,
        help="full-speed trace (default: the shape's); with --trace: its first N (default all)",
    )
    ap.add_argument("--paced-sessions", type=int)
    ap.add_argument("--paced-requests", type=int)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rates", type=floats, default=[2.0, 0.0], help="req/s, 0: full speed")
    ap.add_argument(
        "--speedup",
        type=floats,
        default=[1.0],
        help="with --trace: the recorded clock sped up by each (0: full speed; default 1)",
    )
    ap.add_argument("--caps", type=ints, help="cap = W / each (default 3,2; with --trace 10,5)")
    ap.add_argument("--tp", type=ints, help="TP sizes (default 1,2; with --trace 1)")
    ap.add_argument("--evictors", type=lambda s: s.split(","), default=["sglang", "cachemgr"])
    ap.add_argument("--repeat", type=int, default=1, help="runs of each capped row")
    ap.add_argument("--hogs", type=int, default=0, help="CPU-bound processes running meanwhile")
    ap.add_argument("--page-bytes", type=int, default=2048)
    ap.add_argument("--sample-ms", type=float, default=25.0, help="full-speed runs")
    ap.add_argument("--paced-sample-ms", type=float, default=50.0)
    ap.add_argument("--jobs", type=int, default=8, help="paced runs at once")
    ap.add_argument("--full-jobs", type=int, default=1, help="full-speed runs at once")
    ap.add_argument(
        "--daemon-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a daemon setting (gc_interval=0.5 or CACHEMGR_GC_INTERVAL=0.5)",
    )
    ap.add_argument(
        "--sglang-env",
        type=Path,
        default=Path(os.environ.get("CACHEMGR_SGLANG_ENV", REPO / ".sglang-env")),
    )
    ap.add_argument("--workdir", type=Path, help="keep the runs' roots and logs here")
    ap.add_argument("--json", type=Path, help="also write every row's numbers here")
    args = ap.parse_args(argv)
    if args.trace is not None:
        args.rates = args.speedup  # the worker's rate is the speed of the trace's clock
        args.caps, args.tp = args.caps or [10, 5], args.tp or [1]
    else:
        shape = SHAPES[args.shape]
        args.sessions = args.sessions or shape.sessions
        args.requests = args.requests or shape.requests
        args.paced_sessions = args.paced_sessions or shape.paced_sessions
        args.paced_requests = args.paced_requests or shape.paced_requests
        args.caps, args.tp = args.caps or [3, 2], args.tp or [1, 2]
    if args.quick:
        args.sessions, args.requests, args.rates, args.caps, args.tp = 40, 300, [0.0], [3], [1]
        args.full_jobs = 2  # two small runs side by side
    if min(args.rates) < 0 or args.repeat < 1 or args.hogs < 0 or (args.requests or 1) < 1:
        ap.error("--rates/--speedup must be >= 0, --repeat and --requests >= 1, --hogs >= 0")
    return args


def generated(args: argparse.Namespace, work: Path) -> tuple[dict[str, Path], list[str]]:
    """The two generated traces written for the worker, and a line describing each."""
    knobs = SHAPES[args.shape].knobs
    sizes = {
        "full": (args.sessions, args.requests),
        "paced": (args.paced_sessions, args.paced_requests),
    }
    paths, lines = {}, []
    for name, (sessions, requests) in sizes.items():
        trace = make_trace(sessions, requests, args.seed, **knobs)
        paths[name] = work / f"trace-{name}.json"
        write_trace(trace, paths[name])
        lines.append(
            f"trace {name!r} ({args.shape}): {sessions} sessions, {len(trace.requests)} requests,"
            f" seed {args.seed}, {trace.pages} pages of {args.page_bytes} B per rank,"
            f" restart before request {trace.restart_at}"
        )
    return paths, lines


def recorded(args: argparse.Namespace, work: Path) -> tuple[dict[str, Path], list[str]]:
    """The recorded trace (its first `--requests`) written for the worker, and its line."""
    try:
        rec = read_trace(args.trace, args.requests)
    except (OSError, TraceError) as e:
        raise SystemExit(f"bench_replay: {e}") from None
    path = work / "trace-recorded.json"
    write_recorded(rec, path)
    span = rec.timestamps[-1] - rec.timestamps[0]
    extra = f", {rec.conversations} conversations" if rec.conversations else ""
    line = (
        f"trace {args.trace.name}: first {len(rec.requests)} requests{extra},"
        f" {span:.0f} s recorded, {len(rec.parent)} pages of {args.page_bytes} B per rank,"
        f" {sum(map(len, rec.requests))} page lookups; {rec.relinked} block ids seen after"
        f" another parent; no restart"
    )
    return {"recorded": path}, [line]


@contextmanager
def hogs(n: int) -> Iterator[None]:
    """`n` CPU-bound processes (`python -c 'while 1: pass'`) for the duration."""
    procs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@contextmanager
def workdir(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path.resolve()
    else:
        with tempfile.TemporaryDirectory(prefix="bench_replay.") as tmp:
            yield Path(tmp)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    python = args.sglang_env / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{args.sglang_env} is missing: run scripts/sglang-env.sh")
    with workdir(args.workdir) as work:
        paths, about = (recorded if args.trace is not None else generated)(args, work)
        sample_s = {"full": args.sample_ms / 1000, "paced": args.paced_sample_ms / 1000}
        bench = Bench(work, python, paths, args.page_bytes, sample_s, tuple(args.daemon_env))
        with hogs(args.hogs):
            rows = run_matrix(bench, args)
    used = {r.cfg.trace for r in rows}
    for name, line in zip(paths, about, strict=True):
        if name in used:
            print(line)
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in sorted(rows, key=order)], indent=1))
    print(machine_line(python, load0, args.hogs))
    print(f"({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
