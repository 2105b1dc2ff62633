"""The HTTP side's plumbing: the listening socket, the shared read connection, uvicorn."""

from __future__ import annotations

import errno
import ipaddress
import socket
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp

from cachemgr.daemon.connections import (
    ConnectionBudget,
    ConnectionGuard,
    ConnectionMetrics,
    GuardedH11Protocol,
    open_fds,
)
from cachemgr.errors import ConfigError, PortInUseError
from cachemgr.layout import Layout
from cachemgr.settings import Settings
from cachemgr.state.dbfile import denied_as_unavailable
from cachemgr.state.store import Store

# Also the most connections asyncio accepts per wake-up (cachemgr.daemon.connections): a short
# queue for a sidecar with a few clients, and a small batch of fds not yet counted.
LISTEN_BACKLOG = 64
ACCEPT_QUEUE = 4096  # the kernel caps it at net.core.somaxconn


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses; binding anything else needs a token."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket now, so a busy port fails fast with one line (exit 2)."""
    if ":" in host:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted sockets inherit it: without it a keep-alive client waits out the 40 ms delayed
    # ACK on every response uvicorn writes in two sends (headers, then body).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUseError(f"port {port} on {host} is in use") from None
        raise ConfigError(f"port {port} on {host} cannot be bound: {e.strerror}") from None
    sock.listen(LISTEN_BACKLOG)
    sock.set_inheritable(True)
    return sock


def uvicorn_config(
    app: ASGIApp, settings: Settings, nofile: int, registry: CollectorRegistry
) -> uvicorn.Config:
    """uvicorn with its connections capped below `nofile` (the soft RLIMIT_NOFILE, less the
    fds open now and the reserve) and every request's read timed; their counts in `registry`.

    uvicorn's own limit_concurrency is not used: it counts every open connection, half-sent
    ones too, so a flood at it would have every real request answered 503.
    """
    budget = ConnectionBudget(
        soft_limit=nofile,
        open_now=open_fds(),
        reserve=settings.http_fd_reserve,
        backlog=LISTEN_BACKLOG,
        wanted=settings.http_max_connections,
    )
    guard = ConnectionGuard.within(budget)
    registry.register(ConnectionMetrics(guard))
    protocol = GuardedH11Protocol.bound(guard, settings.http_header_timeout)
    return uvicorn.Config(
        app,
        http=protocol,
        # Not "auto", which takes uvloop wherever it is installed (beside vLLM, or uvicorn's
        # [standard] extra): libuv accepts until the queue is empty, not `backlog` a wake-up,
        # so the fd budget above would not bound a flood, and its loop leaves two pipe fds
        # open after a shutdown.
        loop="asyncio",
        ws="none",
        backlog=LISTEN_BACKLOG,
        timeout_keep_alive=settings.http_keep_alive_timeout,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=10,
    )


class Reader:
    """One read connection shared by HTTP threads and scrapes (sqlite3 objects need a lock).

    Always on the DB at the path (one deleted or moved aside is reopened); a corrupt one
    raises StateCorrupt (HTTP 503) after it is moved aside, and the next read starts anew.
    """

    def __init__(self, layout: Layout) -> None:
        self._store = Store.open(layout.db_path)
        self._state_dir = layout.state_dir
        self._lock = threading.Lock()

    @contextmanager
    def __call__(self) -> Iterator[sqlite3.Connection]:
        with self._lock, denied_as_unavailable(self._state_dir):
            self._store.follow_path()
            with self._store.guard():
                yield self._store.conn

    def close(self) -> None:
        with self._lock:
            self._store.close()


class Server(uvicorn.Server):
    """uvicorn without its signal handling: the daemon owns SIGTERM/SIGINT.

    uvicorn re-raises the signal it caught once its own shutdown ends, which kills the process
    before `Daemon.stop` can apply the last batch and close the DB.
    """

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # asyncio listened with `backlog`, its accept batch; the kernel's queue may be longer
        # (it costs no fds): a burst of connections then waits in it instead of being dropped,
        # so a fresh client is not sent back to SYN retries (1 s, then 3 s).
        for sock in sockets or []:
            sock.listen(ACCEPT_QUEUE)
