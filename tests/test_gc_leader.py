"""Two GC processes on one root: the lock holder deletes, the other reports and does not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cachemgr.fs.leadership import Leadership
from cachemgr.fs.root import create_root
from cachemgr.gc.policy import GcPolicy
from cachemgr.gc.runner import GcRunner, LiveState
from cachemgr.layout import Layout
from cachemgr.state.store import Store
from tests.gc_helpers import NS, Tree, page

# A daemon stand-in: takes GC leadership, says so, waits for a line, then runs GC once.
DAEMON = """
import json, sys, time
from pathlib import Path
from cachemgr.gc.policy import GcPolicy
from cachemgr.gc.runner import GcRunner
from cachemgr.layout import Layout
from cachemgr.state.store import Store
layout = Layout.at(Path(sys.argv[1]))
store = Store.open(layout.db_path)
runner = GcRunner(layout, store, GcPolicy(max_bytes=5_000, min_age=0, delete_rate=None))
print(json.dumps({"leader": runner.leadership.try_acquire()}), flush=True)
sys.stdin.readline()
report = runner.run(actor="auto")
print(json.dumps({"leader": report.leader, "files": report.files}), flush=True)
sys.stdin.readline()
"""


def start_daemon(root: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", DAEMON, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc


def stop(proc: subprocess.Popen[str]) -> None:
    """SIGKILL: no cleanup runs, the kernel drops the flocks."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    for stream in (proc.stdin, proc.stdout):
        assert stream is not None
        stream.close()


@contextmanager
def leading(root: Path) -> Iterator[subprocess.Popen[str]]:
    """The stand-in, leading GC on `root` until the block ends (then killed)."""
    proc = start_daemon(root)
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline()) == {"leader": True}
        yield proc
    finally:
        stop(proc)


def say(proc: subprocess.Popen[str], line: str = "go") -> dict[str, object]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    out: dict[str, object] = json.loads(proc.stdout.readline())
    return out


def cli_gc(root: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "cachemgr",
            "--root",
            str(root),
            *options,
            "gc",
            "--yes",
            "--json",
            "--max-bytes",
            "5000",
            "--min-age",
            "0",
            "--delete-rate",
            "1000000",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_two_processes_exactly_one_deletes(root: Path) -> None:
    tree = Tree.at(root)
    tree.write(NS, [page(i) for i in range(20)], at=1_000_000.0)  # 20,000 bytes, cap 5,000
    tree.store.close()
    with leading(root) as daemon:
        other = cli_gc(root)
        assert other.returncode == 1
        assert f"another process leads GC on {root} (pid {daemon.pid} " in other.stderr
        assert len(os.listdir(root / "ns" / NS)) == 20  # the non-leader deleted nothing
        assert say(daemon) == {"leader": True, "files": 16}
        assert len(os.listdir(root / "ns" / NS)) == 4


def test_a_process_with_another_state_dir_does_not_lead_gc_beside_the_leader(
    root: Path, tmp_path: Path
) -> None:
    """The state dir is a setting: a second process on the root with its own (its own
    gc.lock) also led, and both deleted. The root's flock stops it; once the leader dies it
    leads."""
    tree = Tree.at(root)
    tree.write(NS, [page(i) for i in range(20)], at=1_000_000.0)  # 20,000 bytes, cap 5,000
    tree.store.close()
    other_state = tmp_path / "other-state"
    with leading(root):
        other = cli_gc(root, "--state-dir", str(other_state))
        assert other.returncode == 1, other.stderr
        assert (
            f"another process leads GC on {root} (a process with another state dir than "
            f"{other_state})" in other.stderr
        )
        assert len(os.listdir(root / "ns" / NS)) == 20  # the non-leader deleted nothing
    after = cli_gc(root, "--state-dir", str(other_state))
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout)["leader"] is True
    assert len(os.listdir(root / "ns" / NS)) == 4


def test_leadership_passes_on_when_the_leader_dies(root: Path) -> None:
    Tree.at(root).store.close()
    mine = Leadership(root / ".cachemgr" / "gc.lock")
    with leading(root):
        assert not mine.try_acquire()
    assert mine.try_acquire()
    assert mine.holder() is not None and f"pid {os.getpid()} " in (mine.holder() or "")
    mine.release()


class NotLeader(LiveState):
    """A daemon that does not lead the index."""

    def may_lead(self) -> bool:
        return False


def test_a_runner_that_may_not_lead_never_takes_the_lock(tmp_path: Path) -> None:
    """In the daemon only an index leader leads GC (its watcher is what wakes GC)."""
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    store = Store.open(layout.db_path)
    try:
        runner = GcRunner(layout, store, GcPolicy(), live=NotLeader())
        assert runner.tick() is None and runner.stats.skipped == 1
        assert runner.run(sweep=True).leader is False and not runner.leadership.held
        other = Leadership(layout.state_dir / "gc.lock")
        assert other.try_acquire()  # free for the leader
        other.release()
    finally:
        store.close()
