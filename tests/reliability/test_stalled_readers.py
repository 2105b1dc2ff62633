"""Connections that pipeline requests and never read a response must not hold the connection
cap for good. Each one's response write stalls (the client's window is shut), so its request
is "running" as long as the client likes: with the cap filled by them, a fresh /healthz was
refused for ever, with no token needed (499 such connections under `ulimit -n 1024`).
A response the client does not read is the client waiting, as a half-sent request is.
"""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path

import pytest

from cachemgr.daemon.connections import MIN_CAP
from cachemgr.settings import load_settings
from tests.daemon_helpers import running_daemon
from tests.polling import wait_for

PIPELINED = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 3000
PROMPT = 1.0  # seconds a fresh client may wait for /healthz


def _stalled_reader(port: int) -> socket.socket:
    """A connection with a tiny receive window that sends many requests and reads nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    with contextlib.suppress(BlockingIOError):  # the window is full: the rest never goes
        sock.send(PIPELINED)
    return sock


def _healthz_seconds(port: int) -> float:
    t0 = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            head = s.recv(4096).split(b"\r\n", 1)[0]
    except OSError:
        return float("inf")
    return time.monotonic() - t0 if head == b"HTTP/1.1 200 OK" else float("inf")


def test_connections_that_never_read_their_responses_do_not_shut_out_a_fresh_client(
    tmp_path: Path,
) -> None:
    settings = load_settings(
        root=tmp_path / "root",
        http_max_connections=MIN_CAP,
        http_header_timeout=0.5,
        http_keep_alive_timeout=1,
    )
    with running_daemon(settings) as dm:
        port = dm.daemon.port
        dm.http.close()  # the helper's keep-alive connection is not one of the flood's
        flood = [_stalled_reader(port) for _ in range(MIN_CAP)]
        try:
            wait_for(lambda: _open(dm.daemon), lambda n: n >= MIN_CAP, what="the cap filled")
            # Each one is answered until the kernel's send buffer (autotuned to megabytes) is
            # full; a loaded 2-core box takes longer than a fixed sleep to render that many
            # /metrics. Then it waits for its client, as a half-sent request does.
            wait_for(
                lambda: _stalled(dm.daemon), lambda n: n >= MIN_CAP, timeout=120, what="stalls"
            )
            time.sleep(1.5)  # past every timer (header 0.5 s, keep-alive 1 s)
            took = [_healthz_seconds(port) for _ in range(3)]
        finally:
            for sock in flood:
                sock.close()
    assert max(took) < PROMPT, took


def _open(daemon: object) -> int:
    return len(daemon.server.server_state.connections)  # type: ignore[attr-defined]


def _stalled(daemon: object) -> int:
    """Connections whose response writes are paused (their client reads nothing)."""
    conns = list(daemon.server.server_state.connections)  # type: ignore[attr-defined]
    return sum(1 for c in conns if c.flow.write_paused)


@pytest.mark.parametrize(
    "tail",
    [
        b"GET /healthz HTTP/1.1\r\nHost",
        b"POST /v1/gc HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{",
    ],
    ids=["half-a-head", "half-a-body"],
)
def test_half_a_request_pipelined_behind_a_whole_one_gets_the_header_timeout(
    tmp_path: Path, tail: bytes
) -> None:
    """Its bytes came with the whole request's: no later data_received started its deadline,
    and only the keep-alive timer (up to 300 s) ended it."""
    settings = load_settings(
        root=tmp_path / "root", http_header_timeout=0.5, http_keep_alive_timeout=60
    )
    with (
        running_daemon(settings) as dm,
        # A recv waits twice the bound below for the close before it gives up (fails).
        socket.create_connection(("127.0.0.1", dm.daemon.port), timeout=2 * 5) as sock,
    ):
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" + tail)
        t0 = time.monotonic()
        while sock.recv(4096):
            pass
        took = time.monotonic() - t0
    assert took < 5, took
