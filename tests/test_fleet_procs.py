"""Fleet failures with daemons as processes: the leader killed (-9), paused past its lease
(SIGSTOP, then SIGCONT). Real etcd, real bindfs nodes."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from tests.daemon_helpers import NS_A, page_name, register_namespace
from tests.fleet_bed import IN_DELETE, Etcd, Inotify, bindfs_nodes, need_binaries, running_etcd
from tests.polling import wait_for

pytestmark = pytest.mark.fleet
TTL, RENEW = 3.0, 0.5


class Node:
    """`cachemgr serve` for one node, as a process; its stderr in a file."""

    def __init__(self, i: int, mount: Path, state: Path, etcd: Etcd, env: dict[str, str]):
        self.name, self.state = f"node{i}", state
        self.log = state.with_suffix(".log")
        argv = [sys.executable, "-m", "cachemgr", "--root", str(mount), "serve", "--port", "0"]
        env = {
            **os.environ,
            "CACHEMGR_STATE_DIR": str(state),
            "CACHEMGR_LOG_FORMAT": "json",
            "CACHEMGR_FLEET_COORDINATOR": etcd.coordinator,
            "CACHEMGR_NODE_NAME": self.name,
            "CACHEMGR_FLEET_LEASE_TTL": str(TTL),
            "CACHEMGR_FLEET_RENEW_INTERVAL": str(RENEW),
            **env,
        }
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env)
        self.url = wait_for(self._url, bool, timeout=30, what=f"{self.name} serving")
        wait_for(self._ready, bool, timeout=30, what=f"{self.name} ready")

    def _url(self) -> str | None:
        assert self.proc.poll() is None, self.log.read_text()
        match = re.search(r"serving .* on (http://[0-9.:]+)", self.log.read_text())
        return match.group(1) if match else None

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def fleet(self) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/v1/fleet", timeout=5)
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data

    def leading(self) -> bool:
        try:
            return bool(self.fleet()["leading"])
        except httpx.TransportError:
            return False

    def evictions_since(self, at: float) -> int:
        conn = sqlite3.connect(Layout.at(Path("/"), self.state).db_path)
        try:
            row = conn.execute(
                "SELECT COALESCE(SUM(pages), 0) FROM audit WHERE action = 'evict' AND at > ?",
                (at,),
            ).fetchone()
        finally:
            conn.close()
        return int(row[0])

    def trash_deleted(self) -> int:
        """Pages this node's audit says its trash drains deleted."""
        conn = sqlite3.connect(Layout.at(Path("/"), self.state).db_path)
        try:
            row = conn.execute(
                "SELECT COALESCE(SUM(pages), 0) FROM audit WHERE action = 'delete-trash'"
            ).fetchone()
        finally:
            conn.close()
        return int(row[0])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def bed(tmp: Path, n: int) -> Iterator[tuple[Etcd, list[Path]]]:
    need_binaries()
    with ExitStack() as stack:
        etcd = stack.enter_context(running_etcd(tmp))
        mounts = stack.enter_context(bindfs_nodes(tmp / "backing", tmp / "mnt", n))
        layout = Layout.at(mounts[0], tmp / "state0")
        create_root(layout)
        register_namespace(layout, NS_A)
        yield etcd, mounts


@contextmanager
def nodes(
    tmp: Path, etcd: Etcd, mounts: list[Path], env: dict[str, str] | None = None
) -> Iterator[list[Node]]:
    started: list[Node] = []
    try:
        for i, m in enumerate(mounts):
            started.append(Node(i, m, tmp / f"state{i}", etcd, env or {}))
            if i == 0:  # node0 leads: the tests know whom to kill or pause
                wait_for(started[0].leading, bool, timeout=20, what="node0 leading")
        yield started
    finally:
        for node in started:
            node.stop()


def leaders(live: list[Node]) -> list[str]:
    return [n.name for n in live if n.leading()]


def test_kill_9_of_the_leader_hands_gc_to_another_node_within_30s(tmp_path: Path) -> None:
    with bed(tmp_path, 3) as (etcd, mounts), nodes(tmp_path, etcd, mounts) as fleet:
        fleet[0].proc.kill()
        killed = time.monotonic()
        rest = fleet[1:]
        found = wait_for(lambda: leaders(rest), lambda ls: len(ls) == 1, timeout=30)
        took = time.monotonic() - killed
        assert took < 30, took
        for _ in range(3):  # and it stays one
            time.sleep(1)
            assert leaders(rest) == found


def _stale_temps(ns_dir: Path, n: int) -> None:
    """Temp files of crashed writes, old enough for GC to sweep (gc_tmp_ttl 0)."""
    for _ in range(n):
        (ns_dir / f".{uuid.uuid4().hex}.tmp").write_bytes(b"t")


def _until_a_chunk_is_done(deletes: Inotify) -> list[tuple[int, str]]:
    """The deletions of node0's first chunk, once a quiet 0.3 s says it is paced now."""
    seen: list[tuple[int, str]] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = deletes.read(settle=0.3)
        if seen and not got:
            return seen
        seen += got
    raise AssertionError(f"node0 did not delete a paced chunk in 30 s: {len(seen)} deleted")


def test_a_leader_paused_past_its_lease_deletes_nothing_after_it_resumes(tmp_path: Path) -> None:
    # A paced sweep of stale temps: 256 files a chunk, ~1.3 s of pacing after each.
    env = {
        "CACHEMGR_GC_TMP_TTL": "0s",
        "CACHEMGR_GC_DELETE_RATE": "200",
        "CACHEMGR_GC_INTERVAL": "1h",
    }
    with bed(tmp_path, 2) as (etcd, mounts):
        ns0 = mounts[0] / "ns" / NS_A
        _stale_temps(tmp_path / "backing" / "ns" / NS_A, 3000)
        with nodes(tmp_path, etcd, mounts, env) as (leader, follower):
            deletes = Inotify(ns0, IN_DELETE)  # only node0's own deletions show here
            try:
                token = {"Authorization": "Bearer x"}
                run = threading.Thread(
                    target=lambda: httpx.post(f"{leader.url}/v1/gc", headers=token, timeout=120),
                    daemon=True,
                )
                run.start()
                seen = _until_a_chunk_is_done(deletes)
                assert len(seen) >= 256
                leader.proc.send_signal(signal.SIGSTOP)  # in the pacer's sleep after a chunk
                assert deletes.read(settle=0.5) == []  # nothing was in flight at the stop
                wait_for(follower.leading, bool, timeout=30, what="node1 leading")
                resumed = time.time()
                leader.proc.send_signal(signal.SIGCONT)
                time.sleep(5)  # past the pacer's sleep: node0's next chunk would be due
                assert deletes.read() == []
                assert leader.evictions_since(resumed) == 0
                assert not leader.leading()
                run.join(60)
            finally:
                deletes.close()


def test_a_leader_paused_inside_a_trash_entry_deletes_no_more_of_it_after_it_resumes(
    tmp_path: Path,
) -> None:
    # One purged namespace of 3000 pages in .trash/: a paced drain of 256 files a part,
    # ~1.3 s of pacing after each, so the pause lands inside the entry.
    env = {"CACHEMGR_GC_DELETE_RATE": "200", "CACHEMGR_GC_INTERVAL": "1h"}
    entry = "fedcba9876543210.t1"
    with bed(tmp_path, 2) as (etcd, mounts):
        purged = tmp_path / "backing" / ".trash" / entry
        purged.mkdir(parents=True)
        for i in range(3000):
            (purged / page_name(i)).write_bytes(b"p")
        with nodes(tmp_path, etcd, mounts, env) as (leader, follower):
            # node0 drains it from its election on; only its own deletions show here
            deletes = Inotify(mounts[0] / ".trash" / entry, IN_DELETE)
            try:
                seen = _until_a_chunk_is_done(deletes)
                leader.proc.send_signal(signal.SIGSTOP)
                assert deletes.read(settle=0.5) == []  # nothing was in flight at the stop
                wait_for(follower.leading, bool, timeout=30, what="node1 leading")
                leader.proc.send_signal(signal.SIGCONT)
                time.sleep(5)  # past the pacer's sleep: node0's next part would be due
                assert [e for e in deletes.read() if e[0] & IN_DELETE] == []
                assert not leader.leading()
            finally:
                deletes.close()
            # what it deleted before the pause is audited, and nothing more
            audited = wait_for(leader.trash_deleted, bool, timeout=20, what="node0's audit")
            assert 0 < audited < 3000
            assert audited >= len(seen)


def _kill_fuse_of(mount: Path) -> None:
    """Kill the bindfs serving `mount` (this test's own): its path then answers ENOTCONN, as
    a stale NFS mount answers ESTALE."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"bindfs") and os.fsencode(mount) in argv:
            os.kill(int(pid), signal.SIGKILL)
            return
    raise AssertionError(f"no bindfs serves {mount}")


def test_a_leader_whose_mount_dies_hands_the_lease_over(tmp_path: Path) -> None:
    # Its GC failed every cycle while it kept renewing the lease: no node deleted, for good.
    with bed(tmp_path, 2) as (etcd, mounts), nodes(tmp_path, etcd, mounts) as (leader, follower):
        _kill_fuse_of(mounts[0])
        wait_for(follower.leading, bool, timeout=15, what="node1 leading")
        assert not leader.leading()
        assert "not campaigning for the GC lease" in leader.log.read_text()
