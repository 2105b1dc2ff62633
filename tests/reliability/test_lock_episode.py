"""One foreign write lock held past a writer's patience is one episode: the daemon's writers
give up every 10 s and try again, and each give-up used to log "state DB write lock free
again" while the lock was still held, restart the warning, and reset /readyz's "for N s".
The lock is free when a waiter takes it, not when one gives up."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from cachemgr.errors import StateLocked
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.state import busy
from cachemgr.state.store import Store

HOLDER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
print("held", flush=True)
sys.stdin.readline()
"""
WARNED = "state DB write-locked by another connection; writes wait and are retried"


def _messages(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "cachemgr.state.busy" and r.msg == text]


def test_a_writer_giving_up_does_not_end_the_lock_episode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    caplog.set_level(logging.INFO, logger="cachemgr.state.busy")
    with (
        Store.open(layout.db_path) as store,
        subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(layout.db_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as holder,
    ):
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline() == "held\n"
        episodes = busy.LOCKS.episodes
        for _ in range(2):  # two give-ups while the holder keeps the lock
            with pytest.raises(StateLocked), store.transaction(patience=0.3):
                pass
        assert busy.LOCKS.episodes == episodes + 1
        assert not _messages(caplog, "state DB write lock free again")
        assert len(_messages(caplog, WARNED)) == 1
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(10)
        with store.transaction(patience=10):
            pass
    freed = _messages(caplog, "state DB write lock free again")
    assert len(freed) == 1 and freed[0].seconds >= 0.6, freed  # type: ignore[attr-defined]
