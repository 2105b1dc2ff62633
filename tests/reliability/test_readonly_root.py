"""A root whose filesystem turns read-only under the daemon: GC says so in one line, once, not
a traceback every cycle; a purge answers a problem titled for what it is (not "invalid
configuration"), and moves nothing."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cachemgr.fs.leadership import Leadership
from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from tests.daemon_helpers import (
    NS_A,
    LogLines,
    captured_log,
    page_name,
    register_namespace,
    running_daemon,
    store_page,
)
from tests.nsfixtures import cli, one_line_error
from tests.polling import wait_for


@contextmanager
def read_only(mnt: Path) -> Iterator[None]:
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    try:
        yield
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)


@pytest.fixture
def gc_log() -> Iterator[LogLines]:
    with captured_log("cachemgr.gc.runner") as lines:
        yield lines


def test_a_read_only_root_is_one_gc_line_and_a_true_purge_problem(
    small_fs: Path, tmp_path: Path, gc_log: LogLines
) -> None:
    # The state DB elsewhere: the root's filesystem holds no file open for writing, so it can
    # be remounted read-only under the running daemon, as an operator or a failing disk would.
    settings = load_settings(
        root=small_fs / "root",
        state_dir=tmp_path / "state",
        gc_interval=1,
        gc_max_bytes=1000,
    )
    # The test leads GC until the root is read-only: the cap wins over every protection, so
    # the daemon would otherwise evict the pages as soon as they are indexed.
    held = Leadership(Layout.at(settings.root, settings.state_dir).gc_lock)
    held.try_acquire()
    with running_daemon(settings) as dm:
        ns_dir = register_namespace(dm.daemon.layout, NS_A)
        for i in range(20):
            store_page(ns_dir, page_name(i), 1000)
        wait_for(lambda: dm.namespaces().get(NS_A, {}).get("pages"), lambda n: n == 20)
        before = dm.daemon.gc.stats.error
        with read_only(small_fs):
            held.release()
            # Every cycle tries to evict: three failed cycles at least (one each RUN_GAP, 5 s).
            wait_for(lambda: dm.daemon.gc.stats.error - before, lambda n: n >= 3, timeout=60)
            answer = dm.post(f"/v1/namespaces/{NS_A}/purge")
            out = cli(
                "--root",
                str(settings.root),
                "--state-dir",
                str(settings.state_dir),
                "purge",
                "--namespace",
                NS_A,
                "--yes",
            )
    failed = [x for x in gc_log.lines if str(x["msg"]).startswith("gc cycle failed")]
    assert len(failed) == 1, failed
    assert "exc" not in failed[0] and "Read-only file system" in str(failed[0]["error"])
    assert answer.status_code == 503, answer.text
    problem = answer.json()
    assert problem["title"] == "cache root not writable", problem
    assert "Read-only file system; nothing was moved" in problem["detail"], problem
    assert out.returncode == 2
    assert "is on a read-only filesystem" in one_line_error(out)  # the CLI checks the root first
    assert sorted(p.name for p in ns_dir.iterdir()) == sorted(page_name(i) for i in range(20))
