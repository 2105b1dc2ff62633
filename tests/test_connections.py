"""HTTP connections in number and time (cachemgr.daemon.connections), on the real daemon: a
request not all in within the header timeout is closed; at the cap, a new connection replaces
the oldest idle one; the soft RLIMIT_NOFILE is raised to the hard one at start."""

from __future__ import annotations

import http.client
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cachemgr.daemon.connections import (
    ACCEPT_BATCHES,
    MIN_CAP,
    ConnectionBudget,
    ConnectionGuard,
)
from cachemgr.settings import load_settings
from tests.daemon_helpers import running_daemon
from tests.polling import wait_for
from tests.test_server import metric

HEADER_TIMEOUT = 0.5
CLOSED = "cachemgr_http_connections_closed_total"


def _connect(port: int, send: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if send:
        sock.sendall(send)
    return sock


def _closed_after(sock: socket.socket, since: float | None = None) -> float:
    """Seconds from `since` (default: now) until the server closes `sock` (reading and
    dropping what it sends)."""
    t0 = time.monotonic() if since is None else since
    with sock:
        while sock.recv(4096):
            pass
    return time.monotonic() - t0


def _healthz(port: int) -> bytes:
    with _connect(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n") as s:
        return s.recv(4096).split(b"\r\n", 1)[0]


@pytest.mark.parametrize(
    "send",
    [
        b"",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ",
        b"POST /v1/gc HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
    ],
    ids=["nothing", "half-a-head", "half-a-body"],
)
def test_a_request_not_all_in_within_the_header_timeout_is_closed(
    tmp_path: Path, send: bytes
) -> None:
    settings = load_settings(root=tmp_path / "root", http_header_timeout=HEADER_TIMEOUT)
    with running_daemon(settings) as dm:
        # From before the connection: its deadline starts after this, however long this
        # thread waits (for the GIL, on a loaded CPU) between the connect and the clock read.
        t0 = time.monotonic()
        took = _closed_after(_connect(dm.daemon.port, send), since=t0)
        closed = metric(dm.get("/metrics").text, CLOSED, reason="header_timeout")
    assert HEADER_TIMEOUT * 0.9 <= took < HEADER_TIMEOUT + 3, took
    assert closed == 1


def test_a_kept_alive_connection_gets_a_new_deadline_for_each_request(tmp_path: Path) -> None:
    settings = load_settings(
        root=tmp_path / "root", http_header_timeout=HEADER_TIMEOUT, http_keep_alive_timeout=30
    )
    with running_daemon(settings) as dm, _connect(dm.daemon.port) as sock:
        for _ in range(3):  # each whole request in time, spread past one deadline
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            response = http.client.HTTPResponse(sock)
            response.begin()
            assert response.status == 200 and response.read()
            time.sleep(HEADER_TIMEOUT * 0.6)
        # uvicorn cancels its keep-alive timer at the next byte: half a head still expires
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        took = _closed_after(sock)
    assert took < HEADER_TIMEOUT + 3, took


def test_at_the_cap_a_fresh_client_replaces_the_oldest_idle_connection(tmp_path: Path) -> None:
    settings = load_settings(
        root=tmp_path / "root", http_max_connections=MIN_CAP, http_header_timeout=60
    )
    with running_daemon(settings) as dm:
        port = dm.daemon.port
        dm.http.close()  # the helper's own keep-alive connection: not one of the idle ones
        idle = [_connect(port, b"GET /healthz HTTP/1.1\r\n") for _ in range(MIN_CAP)]
        wait_for(
            lambda: dm.daemon.server is not None and _open(dm.daemon),
            lambda n: n == MIN_CAP,
            timeout=30,
            what="every idle connection accepted",
        )
        assert _healthz(port) == b"HTTP/1.1 200 OK"
        assert _closed_after(idle[0]) < 5  # the oldest made room
        for sock in idle[1:]:
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):  # the others are still open
                sock.recv(1)
            sock.close()
        # The server sees those closes after the scrape's connect if its loop is slow: the
        # scrape's connection would evict another at the cap (counted twice).
        wait_for(lambda: _open(dm.daemon), lambda n: n == 0, timeout=30, what="all closed")
        text = httpx.get(f"{dm.url}/metrics", timeout=10).text
    assert metric(text, CLOSED, reason="evicted") == 1
    assert metric(text, "cachemgr_http_connections_max") == MIN_CAP


def _open(daemon: object) -> int:
    return len(daemon.server.server_state.connections)  # type: ignore[attr-defined]


class Conn:
    """A connection as the guard sees it: waiting for its client or busy with a request."""

    def __init__(self, waiting: bool) -> None:
        self.busy = not waiting
        self.closed = False

    def waiting(self) -> bool:
        return not self.busy

    def close(self) -> None:
        self.closed = True


def test_at_the_cap_the_oldest_waiting_connection_goes_and_a_busy_one_stays() -> None:
    guard = ConnectionGuard(cap=3)
    busy, idle_old, idle_new = Conn(waiting=False), Conn(waiting=True), Conn(waiting=True)
    for conn in (busy, idle_old, idle_new):
        assert guard.admit(conn)
    fresh = Conn(waiting=True)
    assert guard.admit(fresh) and idle_old.closed
    assert not busy.closed and not idle_new.closed and guard.open == 3
    idle_new.busy = fresh.busy = True  # every one runs a request: the next is refused
    assert not guard.admit(Conn(waiting=True))
    assert guard.open == 3 and guard.closed == {"evicted": 1, "refused": 1}


def test_the_cap_leaves_the_reserve_and_accepts_batches_free() -> None:
    budget = ConnectionBudget(soft_limit=1024, open_now=20, reserve=256, backlog=64, wanted=1024)
    assert budget.cap == 1024 - 20 - 256 - ACCEPT_BATCHES * 64
    assert ConnectionBudget(1 << 20, 20, 256, 64, wanted=1024).cap == 1024
    assert ConnectionBudget(300, 20, 256, 64, wanted=1024).cap == MIN_CAP


def test_the_daemon_raises_its_soft_open_file_limit_to_the_hard_one(tmp_path: Path) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2048:
        pytest.skip(f"the hard limit ({hard}) leaves no room to start lower")

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))

    code = (
        "import logging, resource, sys\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from cachemgr.daemon.lifecycle import Daemon\n"
        "from cachemgr.settings import load_settings\n"
        "d = Daemon(load_settings(root=sys.argv[1], port=0))\n"
        "d.start(); d.stop()\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "root")],
        capture_output=True,
        text=True,
        preexec_fn=lower,
        check=True,
    )
    assert int(out.stdout) == hard
    assert "raised the open-file limit" in out.stderr, out.stderr
