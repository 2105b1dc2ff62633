"""`cachemgr serve` as a process: SIGTERM/SIGINT shut it down cleanly (exit 0, last batch in)."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from cachemgr.daemon.lifecycle import Daemon
from cachemgr.errors import StateError
from cachemgr.fs.leadership import Leadership, index_files
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.settings import Settings
from tests.daemon_helpers import NS_A, page_name, register_namespace, store_page
from tests.polling import wait_for


def _lag(url: str) -> float:
    """cachemgr_index_lag_seconds: > 0 while watcher events wait for the next batch."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    match = re.search(r"^cachemgr_index_lag_seconds (\S+)$", text, re.M)
    assert match, text
    return float(match.group(1))


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_applies_the_last_batch_closes_the_db_and_exits_0(
    tmp_path: Path, sig: signal.Signals
) -> None:
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    ns_dir = register_namespace(layout, NS_A)
    env = {
        **os.environ,
        "CACHEMGR_BATCH_INTERVAL": "10",  # the pages below are still queued at SIGTERM
        "CACHEMGR_LOG_FORMAT": "json",
        "CACHEMGR_GC_INTERVAL": "1h",
    }
    argv = [sys.executable, "-m", "cachemgr", "--root", str(layout.root), "serve", "--port", "0"]
    # Its stderr to a file: read from a pipe a line at a time until "serving", then by
    # communicate(), the lines the pipe's buffer had read ahead were lost (under load, when
    # the start-up lines came in one read with "serving": seen as no "index ready").
    log = tmp_path / "daemon.log"
    with (
        log.open("wb") as log_file,
        subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log_file, env=env) as proc,
    ):
        _terminate_after_writing(proc, log, ns_dir, sig)
    err = log.read_text()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert '"daemon stopped"' in err
    assert '"scanned namespace"' in err and '"index ready"' in err  # start-up progress
    conn = sqlite3.connect(layout.db_path)
    try:
        rows = conn.execute("SELECT name FROM pages WHERE namespace_id = ?", (NS_A,)).fetchall()
    finally:
        conn.close()
    assert sorted(r[0] for r in rows) == sorted(names())


def names() -> list[str]:
    return [page_name(i) for i in range(20)]


def _terminate_after_writing(
    proc: subprocess.Popen[bytes], log: Path, ns_dir: Path, sig: int
) -> None:
    """Wait until ready, store pages, signal while they wait for their batch, wait for the
    exit."""
    try:
        url = wait_for(lambda: _serving_url(proc, log), timeout=60, what="the serving line")
        wait_for(lambda: _ready(url), bool, timeout=30)
        for name in names():
            store_page(ns_dir, name)
        wait_for(lambda: _lag(url), lambda lag: lag > 0, timeout=30, what="events queued")
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _serving_url(proc: subprocess.Popen[bytes], log: Path) -> str | None:
    """The URL `serve` says it serves on, once it has said it."""
    text = log.read_text()
    assert proc.poll() is None, f"serve exited with {proc.returncode}: {text}"
    match = re.search(r"serving .* on (http://\S+)", text)
    return match.group(1) if match else None


def test_a_second_signal_cuts_the_wait_for_in_flight_requests_short(settings: Settings) -> None:
    daemon = Daemon(settings.model_copy(update={"port": 0}))
    daemon.start()
    try:
        assert daemon.server is not None
        daemon._on_signal(signal.SIGTERM, None)
        assert (daemon.server.should_exit, daemon.server.force_exit) == (True, False)
        daemon._on_signal(signal.SIGINT, None)  # any second signal, not only SIGINT as uvicorn
        assert daemon.server.force_exit
    finally:
        daemon.stop()


def test_a_failed_index_writer_stops_the_daemon_with_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A daemon whose index is dead must not look alive: it stops, and `serve` reports it
    (the CLI turns that into one line and a non-zero exit; Kubernetes restarts the sidecar)."""
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    ns_dir = register_namespace(layout, NS_A)
    daemon = Daemon(Settings(root=layout.root, port=0))
    daemon.start()
    failed: list[BaseException] = []

    def serve() -> None:
        try:
            daemon.serve()
        except BaseException as e:
            failed.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    wait_for(lambda: _ready(f"http://127.0.0.1:{daemon.port}"), bool, timeout=30)
    daemon.indexer.store.conn.close()  # the writer's next batch fails
    store_page(ns_dir, page_name(1))
    thread.join(30)
    assert not thread.is_alive()
    (error,) = failed
    assert isinstance(error, StateError) and "the index writer failed" in str(error)
    assert not daemon.indexer.up and daemon.gc.up  # the index thread died, and said so once
    died = [r for r in caplog.records if r.getMessage() == "worker died"]
    assert [getattr(r, "worker", None) for r in died] == ["index"]
    index_lock, _ = index_files(layout)  # nothing is left holding the root's locks
    gc_lock = Leadership(layout.state_dir / "gc.lock")
    assert index_lock.try_acquire() and gc_lock.try_acquire()
    index_lock.release()
    gc_lock.release()
