"""A daemon whose page key file cannot be written (its state dir's filesystem out of inodes:
no O_TMPFILE can be made there, while the state DB's files, made before, still take writes)
keeps GC's model's keys in memory and says so beyond its one log line: the metric,
/v1/status and doctor; once the filesystem has room, the next writes move the keys back."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cachemgr.fs.root import create_root
from cachemgr.gc.keyfile import RUN
from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from tests.daemon_helpers import NS_A, page_name, register_namespace, running_daemon, store_burst
from tests.mounts import tmpfs
from tests.polling import wait_for
from tests.test_server import metric

KEPT = "cachemgr_gc_model_keys_in_memory"


def _fill_inodes(at: Path) -> None:
    """Empty files in `at` until its filesystem has no inode left."""
    at.mkdir()
    for i in range(100_000):
        try:
            os.close(os.open(at / str(i), os.O_CREAT | os.O_WRONLY, 0o600))
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
            return
    raise AssertionError(f"{at}'s filesystem never ran out of inodes")


def test_a_daemon_whose_key_file_cannot_be_written_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "cachemgr.gc.keyfile")
    with tmpfs(tmp_path / "state", "64m", inodes=200) as state:
        layout = Layout.at(tmp_path / "root", state)
        create_root(layout)
        d = register_namespace(layout, NS_A, instance="gpu0")
        settings = load_settings(
            root=layout.root, state_dir=state, gc_interval=3600, batch_interval=0.05
        )
        with running_daemon(settings) as dm:
            assert metric(dm.get("/metrics").text, KEPT) == 0  # (nothing held: said so)
            _fill_inodes(state / "filler")
            store_burst(d, [page_name(i) for i in range(RUN + 10)])
            wait_for(lambda: metric(dm.get("/metrics").text, KEPT), lambda n: n == RUN)
            assert dm.status()["gc_model_keys_in_memory"] == RUN
            assert dm.daemon.indexer.model.keys_in_memory == RUN

            env = {**os.environ, "CACHEMGR_PORT": str(dm.daemon.port)}
            argv = ["--root", str(layout.root), "--state-dir", str(state), "doctor", "--json"]
            doc = subprocess.run(
                [sys.executable, "-m", "cachemgr", *argv],
                capture_output=True,
                text=True,
                env=env,
                timeout=120,
            )
            assert doc.returncode != 0, doc.stdout + doc.stderr
            (found,) = [f for f in json.loads(doc.stdout) if f["code"] == "model-keys-in-memory"]
            assert found["severity"] == "warning" and f"{RUN:,} page keys" in found["message"]
            assert str(state) in found["fix"]

            shutil.rmtree(state / "filler")  # room again: the next write takes them back
            store_burst(d, [page_name(i) for i in range(RUN + 10, 2 * RUN + 10)])
            wait_for(lambda: metric(dm.get("/metrics").text, KEPT), lambda n: n == 0)
            assert dm.status()["gc_model_keys_in_memory"] == 0
    said = [r.getMessage() for r in caplog.records if r.name == "cachemgr.gc.keyfile"]
    assert said == [
        "page keys kept in memory: their file cannot be written",
        "page keys back in their file",
    ]
