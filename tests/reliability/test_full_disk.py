"""A full disk: the cache filled the filesystem its state DB lives on, and cachemgr must free it.

Every test runs on a loop-mounted 64 MiB ext4 (`small_fs`) filled with old pages to ENOSPC.
The mechanism under test: a space reserve in the state dir (cachemgr.fs.reserve) released when the
DB cannot open or write, GC's floor pass from a scan of the disk (cachemgr.gc.floor) that needs
no DB, an index writer that retries, and purge making a bound namespace's new dir first.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from cachemgr.fs.reserve import reserve_size
from cachemgr.fs.root import create_root
from cachemgr.layout import RESERVE_FILE, Layout
from cachemgr.settings import load_settings
from cachemgr.units import human_bytes
from tests.daemon_helpers import (
    NS_A,
    NS_B,
    RunningDaemon,
    page_name,
    register_namespace,
    running_daemon,
    wait_for,
)
from tests.nsfixtures import cli, cli_process, one_line_error
from tests.reliability.conftest import fill_with_pages
from tests.test_identity import make_model

FLOOR_PERCENT = 20.0
FLOOR_ENV = {"CACHEMGR_GC_MIN_FREE_PERCENT": str(FLOOR_PERCENT)}
LAUNCH = "sglang serve --enable-hierarchical-cache --hicache-storage-backend file --page-size 64"


def make_full_root(fs: Path, *, state_dir: Path | None = None, reserve: bool = True) -> Layout:
    """A root with a bound namespace (A, instance gpu0) and an unbound one (B), filled to
    ENOSPC with old pages of A; `reserve=False` is a root made before the reserve existed."""
    layout = Layout.at(fs / "root", state_dir)
    create_root(layout)
    register_namespace(layout, NS_A, instance="gpu0")
    register_namespace(layout, NS_B)
    if not reserve:
        (layout.state_dir / RESERVE_FILE).unlink()
    fill_with_pages(layout.ns_dir(NS_A))
    assert free(layout) < 64 << 10
    return layout


def fill_like_sglang(ns_dir: Path, page_bytes: int = 256 << 10) -> int:
    """Store new pages as SGLang does (a `.<uuid>.tmp`, then os.replace) until ENOSPC: the
    watcher sees these, and min-age protects them (GC must free older pages instead)."""
    n = 0
    while page_bytes >= 4096:
        tmp = ns_dir / f".{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(os.urandom(page_bytes))
            # The rename may need a new block for the dir (GC freeing space meanwhile lets
            # the writer go on until it does): SGLang's set then fails and drops the temp.
            os.replace(tmp, ns_dir / page_name(10**9 + n))
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            tmp.unlink(missing_ok=True)
            page_bytes //= 4
            continue
        n += 1
    return n


def free(layout: Layout) -> int:
    return shutil.disk_usage(layout.root).free


def floor(layout: Layout) -> int:
    return int(shutil.disk_usage(layout.root).total * FLOOR_PERCENT / 100)


def pages_on_disk(layout: Layout, ns: str) -> int:
    return sum(1 for n in os.listdir(layout.ns_dir(ns)) if n.endswith(".bin"))


def no_traceback(out: object) -> None:
    assert "Traceback" not in getattr(out, "stderr", ""), getattr(out, "stderr", "")


@pytest.mark.parametrize("reserve", [True, False], ids=["reserve", "no-reserve"])
def test_cli_gc_frees_a_full_disk_down_to_the_floor(small_fs: Path, reserve: bool) -> None:
    """100% full, with or without the reserve: `gc --yes` frees down to the floor and audits."""
    layout = make_full_root(small_fs, reserve=reserve)
    out = cli_process("--root", str(layout.root), "gc", "--yes", env=FLOOR_ENV)
    no_traceback(out)
    assert out.returncode == 0, out.stderr
    assert free(layout) >= floor(layout), (free(layout), floor(layout), out.stdout)
    assert "free_space" in out.stdout
    # Audited once the DB took writes again; the reserve is back for the next time.
    with sqlite3.connect(layout.db_path) as conn:
        (freed,) = conn.execute(
            "SELECT sum(bytes) FROM audit WHERE action = 'evict' AND reason = 'free_space'"
        ).fetchone()
    assert freed and freed > 0
    held = (layout.state_dir / RESERVE_FILE).stat().st_blocks * 512
    assert held >= reserve_size(shutil.disk_usage(layout.root).total)
    assert free(layout) >= floor(layout)


def _commands(model: Path) -> list[list[str]]:
    launch = [*LAUNCH.split(), "--model-path", str(model)]
    return [
        ["ls"],
        ["ls", "--json"],
        ["status", "--port", "1"],
        ["status", "--json", "--port", "1"],
        ["doctor"],
        ["config"],
        ["config", "--check"],
        ["gc", "--dry-run"],
        ["purge", "--all", "--dry-run"],
        ["purge", "--unbound", "--yes"],
        ["fingerprint", "--", *launch],
        ["init", "--instance", "gpu1", "--", *launch],
        ["gc", "--yes"],
    ]


def test_every_command_on_a_full_root_is_at_worst_one_line(small_fs: Path, tmp_path: Path) -> None:
    """Refilled before each command (so the first one finds the reserve, the rest do not)."""
    layout = make_full_root(small_fs)
    model = make_model(tmp_path / "model")
    env = {**FLOOR_ENV, "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": ""}
    for argv in _commands(model):
        fill_with_pages(layout.ns_dir(NS_A))
        out = cli("--root", str(layout.root), *argv, env=env)
        no_traceback(out)
        assert out.returncode in (0, 1, 2), (argv, out.returncode, out.stderr)
        if out.returncode and argv[0] != "doctor":  # doctor prints findings, exit 2 on errors
            one_line_error(out)
    assert free(layout) >= floor(layout)  # the last command, gc --yes, freed it
    assert layout.ns_dir(NS_A).is_dir()


def test_doctor_and_status_report_a_full_filesystem(small_fs: Path) -> None:
    layout = make_full_root(small_fs)
    root = ["--root", str(layout.root)]
    out = cli(*root, "doctor", env=FLOOR_ENV)
    assert out.returncode == 2, out.stdout + out.stderr
    (line,) = [ln for ln in out.stdout.splitlines() if "disk-full" in ln]
    size = human_bytes(shutil.disk_usage(layout.root).total)
    assert line.startswith("error") and f"free of {size} (0." in line, line
    status = cli(*root, "status", "--port", "1", env=FLOOR_ENV)
    assert status.returncode == 0, status.stderr
    assert "filesystem: " in status.stdout and "FULL" in status.stdout, status.stdout
    report = json.loads(cli(*root, "status", "--json", "--port", "1", env=FLOOR_ENV).stdout)
    assert report["filesystem"]["state"] == "full"
    assert report["filesystem"]["free_bytes"] < report["filesystem"]["limit_bytes"]
    # The DB cannot even open (the reserve went to the refill): doctor still says why.
    fill_with_pages(layout.ns_dir(NS_A))
    out = cli(*root, "doctor", env=FLOOR_ENV)
    assert out.returncode == 2 and "disk-full" in out.stdout, out.stdout + out.stderr
    no_traceback(out)
    # Freed: no longer reported full.
    assert cli(*root, "gc", "--yes", env=FLOOR_ENV).returncode == 0
    out = cli(*root, "doctor", env=FLOOR_ENV)
    assert "disk-full" not in out.stdout, out.stdout


def test_purge_all_on_a_full_disk_recreates_the_bound_dir(small_fs: Path) -> None:
    layout = make_full_root(small_fs)
    out = cli("--root", str(layout.root), "purge", "--all", "--yes")
    assert out.returncode == 0, out.stderr
    assert layout.ns_dir(NS_A).is_dir() and pages_on_disk(layout, NS_A) == 0
    assert free(layout) > floor(layout)


def test_purge_without_room_for_the_new_dir_moves_nothing(small_fs: Path, tmp_path: Path) -> None:
    """The state DB elsewhere (so it opens), the root full: no block for the bound namespace's
    new dir. The purge fails before moving it: the instance keeps its dir and its pages."""
    layout = make_full_root(small_fs, state_dir=tmp_path / "state")
    pages = pages_on_disk(layout, NS_A)
    args = ["--root", str(layout.root), "--state-dir", str(layout.state_dir)]
    out = cli(*args, "purge", "--all", "--yes")
    assert "no space" in one_line_error(out)
    assert layout.ns_dir(NS_A).is_dir() and pages_on_disk(layout, NS_A) == pages
    assert cli(*args, "gc", "--yes", env=FLOOR_ENV).returncode == 0  # then it can
    assert cli(*args, "purge", "--all", "--yes").returncode == 0
    assert layout.ns_dir(NS_A).is_dir() and pages_on_disk(layout, NS_A) == 0


@dataclass
class MetricsPoller:
    """Scrapes /metrics every 50 ms on its own thread; every answer and its latency."""

    url: str
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self._stop.wait(0.05):
                t0 = time.perf_counter()
                try:
                    r = http.get(f"{self.url}/metrics")
                    ok = r.status_code == 200 and "cachemgr_up 1.0" in r.text
                    if not ok:
                        self.failures.append(f"{r.status_code}")
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))
                self.latencies.append(time.perf_counter() - t0)

    @contextmanager
    def polling(self) -> Iterator[MetricsPoller]:
        thread = threading.Thread(target=self.run, name="metrics-poller", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join(15)


@pytest.mark.parametrize("reserve", [True, False], ids=["reserve", "no-reserve"])
def test_daemon_frees_a_full_disk_twice_and_serves_metrics_throughout(
    small_fs: Path, reserve: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    layout = make_full_root(small_fs, reserve=reserve)
    settings = load_settings(
        root=layout.root, log_format="json", gc_min_free_percent=FLOOR_PERCENT, batch_interval=0.1
    )
    t0 = time.monotonic()
    with running_daemon(settings) as d, MetricsPoller(d.url).polling() as poller:
        first = wait_for(lambda: free(layout), lambda f: f >= floor(layout), timeout=60)
        took = time.monotonic() - t0
        # A writer fills the disk again while the daemon indexes its pages.
        refilled = fill_like_sglang(layout.ns_dir(NS_A))
        t1 = time.monotonic()
        second = wait_for(lambda: free(layout), lambda f: f >= floor(layout), timeout=60)
        took2 = time.monotonic() - t1
        # The index writer lives and catches up: what it shows is what is on disk.
        wait_for(
            lambda: (d.namespaces()[NS_A]["pages"], pages_on_disk(layout, NS_A)),
            lambda v: v[0] == v[1] and not d.daemon.indexer.state.disk_full,
            timeout=30,
        )
        assert d.daemon.indexer.error is None and d.get("/healthz").status_code == 200
        assert d.daemon.server is not None and not d.daemon.server.should_exit
        retries = d.daemon.indexer.state.disk_full_retries
        # GC may free both fills faster than the poller scrapes ten times: keep scraping.
        wait_for(lambda: len(poller.latencies), lambda n: n > 10, timeout=30)
    assert not poller.failures, poller.failures[:5]
    assert len(poller.latencies) > 10
    worst = max(poller.latencies)
    assert worst < 2.0, worst
    with capsys.disabled():  # the numbers the issue asks for, in the test log
        print(
            f"\n[full disk, reserve={reserve}] floor {floor(layout)} B; freed to {first} B free "
            f"in {took:.2f} s; refilled with {refilled} pages, freed to {second} B in "
            f"{took2:.2f} s; index retries on ENOSPC: {retries}; /metrics x{len(poller.latencies)}"
            f" max {worst * 1000:.0f} ms"
        )


def fill_outside_the_cache(fs: Path) -> None:
    """Another program fills the filesystem: no event the watcher could see."""
    with open(fs / "other-app.log", "ab") as f:
        try:
            while True:
                f.write(os.urandom(64 << 10))
                f.flush()
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise


def gc_settled(d: RunningDaemon, quiet: float = 7.0, timeout: float = 90.0) -> None:
    """Wait until the daemon's GC has done no run for `quiet` seconds (> RUN_GAP): a run's
    own deletions wake it again, which would hide whether anything else does."""
    deadline = time.monotonic() + timeout
    runs, since = d.daemon.gc.stats.ok, time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, "GC never settled"
        time.sleep(0.2)
        if d.daemon.gc.stats.ok != runs:
            runs, since = d.daemon.gc.stats.ok, time.monotonic()


def test_daemon_frees_a_disk_filled_by_another_program_without_waiting_for_its_interval(
    small_fs: Path, tmp_path: Path
) -> None:
    """The free-space floor is checked every few seconds (one statvfs), not only when the
    watcher sees pages or an index write fails: with the state DB elsewhere (so no write
    fails) and gc_interval at an hour, space is still freed within seconds."""
    layout = make_full_root(small_fs, state_dir=tmp_path / "state")
    settings = load_settings(
        root=layout.root,
        state_dir=layout.state_dir,
        log_format="json",
        gc_min_free_percent=FLOOR_PERCENT,
        gc_interval="1h",
    )
    with running_daemon(settings) as d:
        for _ in range(2):
            gc_settled(d)  # nothing left to wake it: no run pending, no deletion in flight
            before = pages_on_disk(layout, NS_A)
            fill_outside_the_cache(small_fs)
            assert free(layout) < floor(layout)
            wait_for(lambda: free(layout), lambda f: f >= floor(layout), timeout=30)
            assert pages_on_disk(layout, NS_A) < before  # pages went; the other file stays
        assert (small_fs / "other-app.log").stat().st_size > 0
