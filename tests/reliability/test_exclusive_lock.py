"""A foreign connection in `PRAGMA locking_mode=EXCLUSIVE` (it keeps its lock after its
first write, readers shut out too) made `cachemgr status` hang with no word for as long as
it held it: the DB copy (sqlite3's backup) retries a locked source for ever. A read-only
command waits a bounded time, then says the DB is locked in one line."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.state.store import Store
from tests.nsfixtures import cli_process

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
