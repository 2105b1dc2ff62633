"""A daemon whose state dir is on a filesystem of its own that fills up (`--state-dir` on a
small tmpfs): the index and GC's records wait for room that GC cannot make there.

It used to go unsaid: `/readyz` 200 "index live", `cachemgr_state_dir_unusable` 0,
`cachemgr_gc_limits_unmet{limit="cap"}` 0 while the pages stayed over the cap, `doctor` "no
problems found", and a log line telling the operator GC would free the space. Now it is said
as an unusable state dir is (the metric, /readyz 503 naming the filesystem, doctor's
`state-db-full`, one log line saying a person must free that filesystem), the cap GC cannot
record its deletions for is said unmet, and all of it clears once there is room again.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachemgr.fs.root import create_root
from cachemgr.layout import RESERVE_FILE, Layout
from cachemgr.ns.quarantine import state_dir_full
from tests.daemon_helpers import NS_A, page_name, register_namespace, store_page
from tests.mounts import tmpfs
from tests.polling import wait_for
from tests.reliability.test_unusable_ns import Daemon, daemon, lines

CAP = 300 << 10  # bytes: 300 pages of 1 KiB
UNUSABLE = "state dir unusable; the daemon waits for it"
USABLE = "state dir usable again"


@pytest.fixture
def state_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs: room for the state DB and its reserve, filled in a moment."""
    with tmpfs(tmp_path / "state-fs", "2m") as mnt:
        yield mnt


def _fill(path: Path) -> None:
    """Write `path` in 4 KiB blocks until the filesystem refuses one."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError as e:
        assert e.errno == errno.ENOSPC
        return
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


def _reserve_released(layout: Layout) -> bool:
    return (layout.state_dir / RESERVE_FILE).stat().st_blocks == 0


def _doctor(layout: Layout, port: int) -> subprocess.CompletedProcess[str]:
    """`cachemgr doctor` on the root, asking the daemon on `port` what its GC holds."""
    argv = [sys.executable, "-m", "cachemgr", "--root", str(layout.root)]
    argv += ["--state-dir", str(layout.state_dir), "doctor"]
    env = {**os.environ, "CACHEMGR_PORT": str(port)}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)


def _unmet_cap(d: Daemon) -> float | None:
    return d.metric("cachemgr_gc_limits_unmet", limit="cap")


def test_a_full_state_dir_filesystem_is_said_and_recovered_from(
    state_fs: Path, tmp_path: Path, free_port: int
) -> None:
    layout = Layout.at(tmp_path / "root", state_fs / "state")
    create_root(layout)
    ns_dir = register_namespace(layout, NS_A, instance="sglang-a")
    log = tmp_path / "daemon.log"
    env = {
        "CACHEMGR_STATE_DIR": str(layout.state_dir),
        "CACHEMGR_GC_MAX_BYTES": str(CAP),
        "CACHEMGR_GC_MIN_FREE_PERCENT": "0",
    }
    fillers = [state_fs / "filler", state_fs / "filler2"]
    with daemon(layout.root, free_port, log, env) as d:
        _fill(fillers[0])
        store_page(ns_dir, page_name(0))  # an index write: ENOSPC, the reserve given back
        wait_for(lambda: _reserve_released(layout), timeout=30, what="the reserve released")
        _fill(fillers[1])  # and what it gave back
        for i in range(1, 601):  # twice the cap
            store_page(ns_dir, page_name(i))
        wait_for(
            lambda: d.metric("cachemgr_state_dir_unusable"),
            lambda v: v == 1,
            timeout=30,
            what="cachemgr_state_dir_unusable 1",
        )
        ready = d.http.get("/readyz")
        assert ready.status_code == 503, ready.text
        detail = ready.json()["detail"]
        assert f"state dir full: the filesystem of {layout.state_dir} is full" in detail, detail
        assert "it is not the root's" in detail, detail
        wait_for(lambda: _unmet_cap(d), lambda v: v == 1, timeout=30, what="the cap said unmet")
        doctor = _doctor(layout, free_port)
        assert doctor.returncode == 2, doctor.stdout + doctor.stderr
        assert "error   state-db-full: the state dir's filesystem is full" in doctor.stdout
        assert "gc-limit-not-held: cap:" in doctor.stdout, doctor.stdout
        (said,) = lines(log, UNUSABLE)
        assert said["reason"] == "full", said
        error = str(said["error"])
        assert f"it is not the root's ({layout.root}), where GC frees space" in error, error
        assert "free space on it" in error, error
        for f in fillers:
            f.unlink()
        wait_for(
            lambda: d.metric("cachemgr_state_dir_unusable"),
            lambda v: v == 0,
            timeout=60,  # the retries back off to 30 s
            what="cachemgr_state_dir_unusable back to 0",
        )
        wait_for(lambda: d.http.get("/readyz").status_code, lambda s: s == 200, timeout=30)
        wait_for(lambda: _unmet_cap(d), lambda v: v == 0, timeout=60, what="the cap held again")
        assert sum(p.stat().st_size for p in ns_dir.iterdir()) <= CAP
        assert "state-db-full" not in _doctor(layout, free_port).stdout
        assert d.alive()
    (back,) = lines(log, USABLE)
    assert back["reason"] == "full", back


def test_a_state_dir_on_the_roots_filesystem_says_gc_frees_it(tmp_path: Path) -> None:
    layout = Layout.at(tmp_path / "root")  # the state dir inside it
    create_root(layout)
    said = state_dir_full(layout)
    assert said.endswith("it is the root's, and GC frees space there"), said
