"""The daemon's side of bench/bench_replay.py: a cache root as `cachemgr init` leaves it,
`cachemgr serve` as a restartable subprocess on a loopback port, and the sampler of the page
bytes on disk."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from itertools import repeat
from pathlib import Path
from typing import IO

import httpx

from cachemgr.fs.dirscan import scan_usage
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.ns.registry import bind, ensure_namespace
from cachemgr.state.store import Store

CACHEMGR = Path(sys.executable).parent / "cachemgr"
NS = "5eb1a7c0ffee0001"
INSTANCE = "replay"
LOW = 0.9  # SGLang's default eviction_ratio, and the daemon's low watermark here
IDENTITY = {
    "kv_cache_dtype": "bfloat16",
    "page_size": 64,
    "source": {"served_model_name": "bench/replay", "model_path": "/models/replay"},
}


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
CPU = "cpu_seconds"  # the daemon's CPU time: what a load that slows the writer does not hide


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
        self.counters[CPU] = self.counters.get(CPU, 0.0) + cpu_seconds(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"cachemgr serve ignored SIGTERM; see {self.log.name}") from None


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a live process (proc(5): fields 14 and 15 of its stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric(text: str, name: str, labels: str) -> float | None:
    """The sum of a metric's samples whose labels contain `labels` (Prometheus text format)."""
    found = None
    for m in re.finditer(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.MULTILINE):
        if labels in (m.group(1) or ""):
            found = (found or 0.0) + float(m.group(2))
    return found


def daemon_env(layout: Layout, cap: int, extra: Sequence[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEMGR_", "SGLANG_"))}
    env.update(
        {
            "CACHEMGR_ROOT": str(layout.root),
            "CACHEMGR_INSTANCE": INSTANCE,
            "CACHEMGR_LOG_LEVEL": "warning",
            "CACHEMGR_LOG_FORMAT": "text",
            "CACHEMGR_GC_MAX_BYTES": str(cap),
            "CACHEMGR_GC_HIGH_WATERMARK": "1.0",
            "CACHEMGR_GC_LOW_WATERMARK": str(LOW),
            "CACHEMGR_GC_MIN_AGE": "0",
            "CACHEMGR_GC_DELETE_RATE": "1e9",
            "CACHEMGR_GC_INTERVAL": "1",
        }
    )
    for item in extra:
        key, _, value = item.partition("=")
        env[key if key.startswith("CACHEMGR_") else f"CACHEMGR_{key.upper()}"] = value
    return env
