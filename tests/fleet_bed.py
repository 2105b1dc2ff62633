"""The fleet test bed: a real etcd on loopback ports, and "nodes" that are bindfs (FUSE
pass-through) mounts of one backing dir, so each node's inotify sees only its own accesses, as
an NFS client sees only its own.

Both binaries come from Debian (scripts/test-deps.sh installs them); a test that needs one
that is missing is skipped, naming it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.polling import wait_for

ETCD = shutil.which("etcd")
BINDFS = shutil.which("bindfs")


def need_binaries() -> None:
    """Skip (naming what is missing) unless etcd and bindfs are installed and FUSE works."""
    missing = [name for name, path in (("etcd", ETCD), ("bindfs", BINDFS)) if path is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (scripts/test-deps.sh installs them)")
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("bindfs mounts need /dev/fuse and root")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Etcd:
    """One etcd member on loopback ports with its own data dir; stop() and start() again keep
    its data (a coordinator outage)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir.with_suffix(".log")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def coordinator(self) -> str:
        """The CACHEMGR_FLEET_COORDINATOR value for it."""
        return f"etcd://{self.endpoint}"

    def start(self) -> None:
        assert ETCD is not None
        client, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        argv = [
            ETCD,
            "--name=bed",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=bed={peer}",
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=log)
        wait_for(self.healthy, bool, timeout=30, what="etcd to serve")

    def healthy(self) -> bool:
        try:
            r = httpx.get(f"http://{self.endpoint}/health", timeout=2)
        except httpx.TransportError:
            return False
        return r.status_code == 200 and r.json().get("health") == "true"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


@contextmanager
def running_etcd(tmp: Path) -> Iterator[Etcd]:
    """A real etcd for the test, stopped after it."""
    etcd = Etcd(tmp / "etcd-data")
    etcd.start()
    try:
        yield etcd
    finally:
        etcd.stop()


@contextmanager
def bindfs_nodes(backing: Path, mounts: Path, n: int) -> Iterator[list[Path]]:
    """`n` pass-through mounts of `backing`, one per node, unmounted after the test."""
    assert BINDFS is not None
    backing.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    try:
        for i in range(n):
            path = mounts / f"node{i}"
            path.mkdir(parents=True)
            # No kernel caching of names and attributes: one node sees another's deletions at
            # once, as NFS with actimeo=0 would (the cap is checked over the backing dir).
            opts = "entry_timeout=0,attr_timeout=0,negative_timeout=0"
            subprocess.run([BINDFS, "-o", opts, str(backing), str(path)], check=True)
            paths.append(path)
        yield paths
    finally:
        for path in paths:
            subprocess.run(["umount", "-l", str(path)], check=False)


def page_bytes_in(ns_dir: Path) -> int:
    """Page bytes in a namespace dir now (a page deleted while it is listed counts as gone)."""
    total = 0
    with os.scandir(ns_dir) as entries:
        for e in entries:
            if e.name.endswith(".bin"):
                with contextlib.suppress(FileNotFoundError):
                    total += e.stat().st_size
    return total


# A minimal inotify reader (libc), so the bed checks the kernel's behaviour itself, not the
# watcher under test.
_libc = ctypes.CDLL(None, use_errno=True)
IN_ACCESS, IN_CLOSE_NOWRITE, IN_MOVED_TO, IN_DELETE = 0x1, 0x10, 0x80, 0x200
IN_CLOSE_WRITE, IN_CREATE = 0x8, 0x100
_EVENT = struct.Struct("iIII")


class Inotify:
    """Events of one watched dir, as (mask, name)."""

    def __init__(self, path: Path, mask: int) -> None:
        self.fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        wd = _libc.inotify_add_watch(self.fd, os.fsencode(path), mask)
        assert wd >= 0, os.strerror(ctypes.get_errno())

    def read(self, settle: float = 0.3) -> list[tuple[int, str]]:
        """What arrived, after waiting `settle` seconds for stragglers."""
        time.sleep(settle)
        events: list[tuple[int, str]] = []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return events
            at = 0
            while at < len(buf):
                _, mask, _, length = _EVENT.unpack_from(buf, at)
                raw = buf[at + _EVENT.size : at + _EVENT.size + length]
                events.append((mask, raw.rstrip(b"\0").decode()))
                at += _EVENT.size + length

    def close(self) -> None:
        os.close(self.fd)
