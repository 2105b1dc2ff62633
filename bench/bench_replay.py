"""Replay through SGLang's HiCacheFile (issue #13, item 6): SGLang's evictor against cachemgr's.

The simulator's trace (bench/sim_policy.py `make_trace`: Zipf sessions, a shared system prefix,
histories that grow and reset, a server restart halfway) goes through SGLang's real
`HiCacheFile` (bench/replay_worker.py, in the .sglang-env), served as SGLang serves it: the
longest contiguous prefix on disk is looked up (`batch_exists`) and loaded (`batch_get`), MIN
over the TP ranks as SGLang all-reduces it, and the rest written through (`batch_set`). Each
TP rank has its own `HiCacheFile` and file suffix. Pages are small (`--page-bytes`) so the
bytes written with no cap, W, are tens of MB. Two evictors on the same trace:

* `sglang`: SGLang's own `LRUFileEvictor`, `SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE` = cap / TP per
  rank (its cap is per rank), its default `eviction_ratio` (0.9). At the restart a fresh
  `HiCacheFile` seeds its LRU from the directory by mtime.
* `cachemgr`: no SGLang cap; the real daemon (`cachemgr serve`, a subprocess on a loopback
  port) on a root whose namespace dir HiCacheFile writes to, with `gc_max_bytes` = cap,
  watermarks 1.0 → 0.9, `gc_min_age` 0, deletes unpaced (a rate of 1e9/s: the setting has no
  "off" value), a short `gc_interval`; `--daemon-env KEY=VALUE` adds or overrides settings.
  At the restart the daemon is restarted too (SIGTERM, start again).

Per row: page hit ratio (pages loaded / pages looked up; also after the restart alone), the
most page bytes ever on disk / cap (a sampler sums page file sizes every `--sample-ms` over the
whole run) and the least once they first reached 0.9 x cap (over-eviction), page files on disk
at the end that no request can load (a page before them in their chain, or their page on
another rank, is missing), and for cachemgr the difference to SGLang's hit ratio. Caps are
fractions of W, measured by an uncapped run of the same trace first. With `--workdir` each
run's root, logs (the daemon's too) and `samples.csv` (bytes on disk over time) are kept.

Paced runs (`--rates`, requests/s; 0 = as fast as SGLang's class goes) use a smaller trace
(`--paced-sessions`, `--paced-requests`) and run concurrently (`--jobs`), each on its own root
and port; full-speed runs go one at a time (`--full-jobs`) so they do not share the CPU.

    .venv/bin/python bench/bench_replay.py            # the matrix: caps W/3, W/2; ~2 req/s and
                                                      # full speed; TP 1 and 2 (15-20 min on a
                                                      # shared 2-core VM at load 5-20)
    .venv/bin/python bench/bench_replay.py --quick    # one small configuration (25-40 s)
    .venv/bin/python bench/bench_replay.py --shape pressured   # issue #13's trace shape

The .sglang-env is `$CACHEMGR_SGLANG_ENV` or ./.sglang-env (`--sglang-env`; `make sglang-env`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from itertools import repeat
from pathlib import Path
from typing import IO, Any

import httpx
from sim_policy import SHAPES, Trace, make_trace

from cachemgr.fs.dirscan import scan_usage
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.ns.registry import bind, ensure_namespace
from cachemgr.state.store import Store

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "bench" / "replay_worker.py"
CACHEMGR = Path(sys.executable).parent / "cachemgr"
NS = "5eb1a7c0ffee0001"
INSTANCE = "replay"
LOW = 0.9  # SGLang's default eviction_ratio, and the daemon's low watermark here
IDENTITY = {
    "kv_cache_dtype": "bfloat16",
    "page_size": 64,
    "source": {"served_model_name": "bench/replay", "model_path": "/models/replay"},
}


@dataclass(frozen=True)
class Config:
    trace: str  # "full" or "paced": which trace
    rate: float  # requests/s; 0: as fast as it goes
    tp: int
    cap_div: int | None  # the cap is W / cap_div; None: no cap
    evictor: str  # "sglang", "cachemgr" or "none"

    @property
    def name(self) -> str:
        cap = f"w{self.cap_div}" if self.cap_div else "nocap"
        return f"{self.trace}-r{self.rate:g}-tp{self.tp}-{cap}-{self.evictor}"


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


class Sampler(threading.Thread):
    """The page bytes on disk every `interval` s (start to start), and their maximum.

    A sample counts the `.bin` names (one getdents pass, ~5x cheaper than a stat of each file,
    which matters with 8 runs sampling at once on 2 cores) times the page size: HiCacheFile
    writes a page through a temp file and a rename, so every page file has the full size. The
    last sample, at the end, sums the real sizes with cachemgr's scanner and checks that.
    """

    def __init__(self, layout: Layout, page_bytes: int, interval: float, full: int) -> None:
        super().__init__(name="replay-sampler", daemon=True)
        self.layout, self.page_bytes, self.interval = layout, page_bytes, interval
        self.dir = layout.ns_dir(NS)
        self.max_bytes = self.last_bytes = self.samples = 0
        self.full = full  # from the first sample at or above this many bytes on, track the least
        self.min_full: int | None = None
        self.series: list[tuple[float, int]] = []  # (seconds since start, bytes) per sample
        self.marks: list[tuple[float, str]] = []  # (seconds since start, what happened)
        self.started = self.ended = 0.0
        self._halt = threading.Event()

    def sample(self) -> None:
        n = sum(map(str.endswith, os.listdir(self.dir), repeat(".bin")))  # the loop in C
        self.last_bytes = n * self.page_bytes
        self.max_bytes = max(self.max_bytes, self.last_bytes)
        if self.min_full is not None:
            self.min_full = min(self.min_full, self.last_bytes)
        elif self.last_bytes >= self.full:
            self.min_full = self.last_bytes
        self.samples += 1
        self.series.append((time.monotonic() - self.started, self.last_bytes))

    def start(self) -> None:
        self.started = time.monotonic()
        super().start()

    def run(self) -> None:
        next_at = self.started
        while not self._halt.wait(max(0.0, next_at - time.monotonic())):
            next_at += self.interval
            self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.ended = time.monotonic()
        usage = scan_usage(self.layout, f"ns/{NS}")
        self.last_bytes = usage.bytes if usage else 0
        if usage is not None and usage.bytes != usage.files * self.page_bytes:
            raise RuntimeError(f"page files of another size than {self.page_bytes} B: {usage}")
        self.max_bytes = max(self.max_bytes, self.last_bytes)

    def mark(self, what: str) -> None:
        self.marks.append((time.monotonic() - self.started, what))

    def write(self, path: Path) -> None:
        """The bytes on disk over time as CSV (the marks as comments), for a plot."""
        lines = [f"# {t:.3f} s: {what}" for t, what in self.marks] + ["seconds,bytes"]
        lines += [f"{t:.3f},{n}" for t, n in self.series]
        path.write_text("\n".join(lines) + "\n")

    @property
    def mean_interval(self) -> float:
        return (self.ended - self.started) / max(1, self.samples)


def make_root(path: Path) -> Layout:
    """A cache root with one namespace bound to an instance, as `cachemgr init` leaves it."""
    layout = Layout.at(path)
    create_root(layout)
    store = Store.open(layout.db_path)
    try:
        now = time.time()
        ensure_namespace(layout, store, ns_id=NS, digest=NS * 4, identity=IDENTITY, now=now)
        with store.transaction():
            bind(layout, store, INSTANCE, NS, now)
    finally:
        store.close()
    return layout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


COUNTERS = {  # daemon metrics worth a note: name -> label filter
    "cachemgr_watcher_overflows_total": "",
    "cachemgr_evicted_pages_total": 'reason="cap"',
    "cachemgr_gc_runs_total": 'result="ok"',
}


DIED = "daemon exits on its own"


class DaemonProc:
    """`cachemgr serve` in a subprocess on a loopback port; restartable."""

    def __init__(self, layout: Layout, env: dict[str, str], log: IO[str]) -> None:
        self.layout, self.env, self.log = layout, env, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.counters: dict[str, float] = {}

    def start(self) -> None:
        for _ in range(3):  # a free port can be taken by another run between probe and bind
            port = free_port()
            env = {**self.env, "CACHEMGR_PORT": str(port)}
            self.proc = subprocess.Popen(
                [str(CACHEMGR), "serve"], env=env, stdout=self.log, stderr=self.log
            )
            self.url = f"http://127.0.0.1:{port}"
            if self._wait_ready(60):
                return
        raise RuntimeError(f"cachemgr serve did not become ready; see {self.log.name}")

    def _wait_ready(self, timeout: float) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.proc.kill()
        self.proc.wait()
        return False

    def stop(self) -> None:
        """Scrape the counters, then SIGTERM (as a service manager stops it) and wait."""
        assert self.proc is not None
        if self.proc.poll() is not None:  # it died mid-run: the row says so
            self.counters[DIED] = self.counters.get(DIED, 0.0) + 1
            return
        try:
            text = httpx.get(f"{self.url}/metrics", timeout=10).text
            for name, labels in COUNTERS.items():
                got = metric(text, name, labels)
                if got is not None:
                    self.counters[name] = self.counters.get(name, 0.0) + got
        except httpx.HTTPError:
            pass
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"cachemgr serve ignored SIGTERM; see {self.log.name}") from None


def metric(text: str, name: str, labels: str) -> float | None:
    """The sum of a metric's samples whose labels contain `labels` (Prometheus text format)."""
    found = None
    for m in re.finditer(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.MULTILINE):
        if labels in (m.group(1) or ""):
            found = (found or 0.0) + float(m.group(2))
    return found


def daemon_env(layout: Layout, cap: int, extra: Sequence[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEMGR_", "SGLANG_"))}
    env.update({
        "CACHEMGR_ROOT": str(layout.root), "CACHEMGR_INSTANCE": INSTANCE,
        "CACHEMGR_LOG_LEVEL": "warning", "CACHEMGR_LOG_FORMAT": "text",
        "CACHEMGR_GC_MAX_BYTES": str(cap), "CACHEMGR_GC_HIGH_WATERMARK": "1.0",
        "CACHEMGR_GC_LOW_WATERMARK": str(LOW), "CACHEMGR_GC_MIN_AGE": "0",
        "CACHEMGR_GC_DELETE_RATE": "1e9", "CACHEMGR_GC_INTERVAL": "1",
    })  # fmt: skip
    for item in extra:
        key, _, value = item.partition("=")
        env[key if key.startswith("CACHEMGR_") else f"CACHEMGR_{key.upper()}"] = value
    return env


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
        job.write_text(json.dumps({
            "trace": str(self.traces[cfg.trace]), "dir": str(layout.ns_dir(NS)),
            "tp": cfg.tp, "rate": cfg.rate, "page_bytes": self.page_bytes,
        }))  # fmt: skip
        with open(run_dir / "log.txt", "w") as log:
            daemon = None
            if cfg.evictor == "cachemgr":
                assert cap is not None
                daemon = DaemonProc(layout, daemon_env(layout, cap, self.daemon_extra), log)
                daemon.start()
            # full = the low watermark: what both evictors evict down to (the cap at most)
            full = int((cap or 0) * LOW) or sys.maxsize
            sampler = Sampler(layout, self.page_bytes, self.sample_s[cfg.trace], full)
            sampler.start()
            try:
                result = self._replay(job, worker_env(cfg, cap), log, daemon, sampler)
            finally:
                sampler.stop()
                sampler.write(run_dir / "samples.csv")
                if daemon is not None and daemon.proc is not None:
                    daemon.stop()
        return Row(
            cfg, cap, result["hits"], result["lookups"], sampler.max_bytes, sampler.last_bytes,
            result["files_end"], result["unusable_end"], result["requests"] / result["elapsed"],
            result["races"], result["set_failures"], sampler.mean_interval, sampler.min_full,
            daemon.counters if daemon else {},
        )  # fmt: skip

    def _replay(
        self,
        job: Path,
        env: dict[str, str],
        log: IO[str],
        daemon: DaemonProc | None,
        sampler: Sampler,
    ) -> dict[str, Any]:
        proc = subprocess.Popen(
            [str(self.sglang_python), str(WORKER), str(job)], env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
        )  # fmt: skip
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
    path.write_text(json.dumps({
        "parent": trace.parent, "requests": trace.requests, "restart_at": trace.restart_at,
    }))  # fmt: skip


def run_matrix(bench: Bench, args: argparse.Namespace) -> list[Row]:
    """Two lanes at once: paced runs concurrently (`--jobs`, they mostly wait), full-speed runs
    one at a time (`--full-jobs`) so they do not share the CPU. Each lane first runs its trace
    uncapped (W, for each TP size), at full speed: with no cap the rate changes nothing."""
    lanes: dict[str, list[Config]] = {"paced": [], "full": []}
    for rate in args.rates:
        trace = "full" if rate == 0 else "paced"
        for tp in args.tp:
            for div in args.caps:
                lanes[trace] += [Config(trace, rate, tp, div, ev) for ev in args.evictors]
    jobs = {"paced": args.jobs, "full": args.full_jobs}

    def lane(trace: str) -> list[Row]:
        rows = [bench.run(Config(trace, 0, tp, None, "none"), None) for tp in args.tp]
        w = {r.cfg.tp: r.end_bytes for r in rows}
        with ThreadPoolExecutor(max(1, jobs[trace])) as pool:
            rows += pool.map(lambda c: bench.run(c, w[c.tp] // (c.cap_div or 1)), lanes[trace])
        return rows

    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lane, [t for t, cfgs in lanes.items() if cfgs]))
    return [row for rows in done for row in rows]


EVICTORS = ("none", "sglang", "cachemgr")


def order(r: Row) -> tuple[Any, ...]:
    """Each trace's uncapped runs first, then by rate, TP, cap (tightest first), evictor."""
    c = r.cfg
    return (
        c.trace == "full",
        c.rate if r.cap else -1,
        c.tp,
        -(c.cap_div or 0),
        EVICTORS.index(c.evictor),
    )


def table(rows: list[Row]) -> str:
    lines = [
        "| req/s | TP | cap | evictor | page hit ratio | after restart | Δ vs SGLang |"
        " max on disk / cap | min once full | unusable at end | page files at end |"
        " achieved req/s | notes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = {
        (r.cfg.rate, r.cfg.tp, r.cfg.cap_div): r.ratio for r in rows if r.cfg.evictor == "sglang"
    }
    for r in sorted(rows, key=order):
        c = r.cfg
        rate = "full" if c.rate == 0 else f"~{c.rate:g}"
        rate = f"({c.trace} trace)" if r.cap is None else rate
        cap = "none" if r.cap is None else f"W/{c.cap_div} ({r.cap / 1e6:.1f} MB)"
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
                f" {r.daemon.get('cachemgr_evicted_pages_total', 0):.0f} pages evicted"
            )
        if r.daemon.get(DIED):
            notes.append(f"**the daemon died {r.daemon[DIED]:.0f}x** (see its log)")
        overflows = r.daemon.get("cachemgr_watcher_overflows_total")
        if overflows:
            notes.append(f"{overflows:.0f} inotify overflows")
        lines.append(
            f"| {rate} | {c.tp} | {cap} | {c.evictor if r.cap else 'no cap'} | {r.ratio:.3f} |"
            f" {r.ratio_after:.3f} | {delta} | {fill} | {least} | {r.unusable_end} |"
            f" {r.files_end} | {r.rate:.1f} | {'; '.join(notes)} |"
        )
    return "\n".join(lines)


def machine_line(sglang_python: Path, load0: float) -> str:
    queue = Path("/proc/sys/fs/inotify/max_queued_events")
    sglang = sorted(
        sglang_python.parent.parent.glob("lib/python*/site-packages/sglang-*.dist-info")
    )
    version = sglang[0].name.removesuffix(".dist-info").split("-")[1] if sglang else "?"
    return (
        f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus,"
        f" {platform.system()} {platform.release()}; Python {platform.python_version()};"
        f" SGLang {version}; load average {load0:.2f} -> {os.getloadavg()[0]:.2f};"
        f" fs.inotify.max_queued_events {queue.read_text().strip() if queue.exists() else '?'}"
    )


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one small configuration (< 60 s)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="default", help="trace shape")
    ap.add_argument("--sessions", type=int, help="full-speed trace (default: the shape's)")
    ap.add_argument("--requests", type=int, help="full-speed trace (default: the shape's)")
    ap.add_argument("--paced-sessions", type=int)
    ap.add_argument("--paced-requests", type=int)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rates", type=floats, default=[2.0, 0.0], help="req/s, 0: full speed")
    ap.add_argument("--caps", type=ints, default=[3, 2], help="cap = W / each")
    ap.add_argument("--tp", type=ints, default=[1, 2])
    ap.add_argument("--evictors", type=lambda s: s.split(","), default=["sglang", "cachemgr"])
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
    shape = SHAPES[args.shape]
    args.sessions = args.sessions or shape.sessions
    args.requests = args.requests or shape.requests
    args.paced_sessions = args.paced_sessions or shape.paced_sessions
    args.paced_requests = args.paced_requests or shape.paced_requests
    if args.quick:
        args.sessions, args.requests, args.rates, args.caps, args.tp = 40, 300, [0.0], [3], [1]
        args.full_jobs = 2  # two small runs side by side
    return args


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
    knobs = SHAPES[args.shape].knobs
    traces = {
        "full": make_trace(args.sessions, args.requests, args.seed, **knobs),
        "paced": make_trace(args.paced_sessions, args.paced_requests, args.seed, **knobs),
    }
    with workdir(args.workdir) as work:
        paths = {name: work / f"trace-{name}.json" for name in traces}
        for name, trace in traces.items():
            write_trace(trace, paths[name])
        sample_s = {"full": args.sample_ms / 1000, "paced": args.paced_sample_ms / 1000}
        bench = Bench(work, python, paths, args.page_bytes, sample_s, tuple(args.daemon_env))
        rows = run_matrix(bench, args)
    sessions = {"full": args.sessions, "paced": args.paced_sessions}
    for name, trace in traces.items():
        if any(r.cfg.trace == name for r in rows):
            print(
                f"trace {name!r} ({args.shape}): {sessions[name]} sessions,"
                f" {len(trace.requests)} requests,"
                f" seed {args.seed}, {trace.pages} pages of {args.page_bytes} B per rank,"
                f" restart before request {trace.restart_at}"
            )
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in sorted(rows, key=order)], indent=1))
    print(machine_line(python, load0))
    print(f"({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
