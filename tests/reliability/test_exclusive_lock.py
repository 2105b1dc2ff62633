"""A foreign connection in `PRAGMA locking_mode=EXCLUSIVE` (it keeps its lock after its
first write, readers shut out too) made `cachemgr status` hang with no word for as long as
it held it: the DB copy (sqlite3's backup) retries a locked source for ever. A read-only
command waits a bounded time, then says the DB is locked in one line."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.state.store import Store
from tests.nsfixtures import cli_process
from tests.polling import wait_for

HOLDER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA locking_mode=EXCLUSIVE")
db.execute("BEGIN IMMEDIATE")
db.execute("CREATE TABLE foreign_tool(a)")
db.execute("COMMIT")
print("held", flush=True)
sys.stdin.readline()
"""


def test_status_under_a_foreign_exclusive_lock_says_so_in_bounded_time(tmp_path: Path) -> None:
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    Store.open(layout.db_path).close()  # the daemon's DB: WAL mode
    with subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(layout.db_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline() == "held\n"
        t0 = time.monotonic()
        try:
            out = cli_process("--root", str(layout.root), "status")
        finally:
            holder.stdin.write("\n")
            holder.stdin.flush()
        took = time.monotonic() - t0
    assert took < 30, took
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert "locked" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_the_daemon_started_under_a_foreign_exclusive_lock_serves_and_starts_after_it(
    tmp_path: Path, free_port: int
) -> None:
    """It used to answer nothing for ~30 s, then exit 2 ('cannot open state DB: database
    is locked'): a supervisor restarts it for ever. Now HTTP says why it is not ready."""
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    Store.open(layout.db_path).close()
    argv = [sys.executable, "-m", "cachemgr", "--root", str(layout.root), "serve"]
    url = f"http://127.0.0.1:{free_port}"
    with (
        subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(layout.db_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as holder,
        subprocess.Popen(
            [*argv, "--port", str(free_port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        ) as daemon,
    ):
        assert holder.stdout is not None and holder.stdin is not None
        try:
            assert holder.stdout.readline() == "held\n"
            answered = _healthz_within(f"{url}/healthz", 20)
            readyz = httpx.get(f"{url}/readyz", timeout=5)
            metrics = httpx.get(f"{url}/metrics", timeout=5)
            status = httpx.get(f"{url}/v1/status", timeout=5)
        finally:
            holder.stdin.write("\n")
            holder.stdin.flush()
        try:
            ready = wait_for(
                lambda: _ready(f"{url}/readyz"), bool, timeout=60, what="ready after the lock"
            )
        finally:
            daemon.send_signal(signal.SIGTERM)
            try:
                code = daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                code = None
            assert daemon.stderr is not None
            err = daemon.stderr.read()
    assert answered
    assert readyz.status_code == 503, readyz.text
    detail = readyz.json()["detail"]
    assert f"pid {holder.pid}" in detail and "locked" in detail, detail
    assert metrics.status_code == 200 and "cachemgr_state_db_locked 1.0" in metrics.text
    assert status.status_code == 503 and f"pid {holder.pid}" in status.json()["detail"]
    assert status.headers["content-type"] == "application/problem+json"
    assert ready
    assert code == 0, err
    assert "Traceback" not in err, err


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _healthz_within(url: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    return False
