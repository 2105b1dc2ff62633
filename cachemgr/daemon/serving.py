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

from cachemgr.errors import ConfigError, PortInUseError
from cachemgr.layout import Layout
from cachemgr.state.store import Store


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
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class Reader:
    """One read connection shared by HTTP threads and scrapes (sqlite3 objects need a lock).

    Always on the DB at the path (one deleted or moved aside is reopened); a corrupt one
    raises StateCorrupt (HTTP 503) after it is moved aside, and the next read starts anew.
    """

    def __init__(self, layout: Layout) -> None:
        self._store = Store.open(layout.db_path)
        self._lock = threading.Lock()

    @contextmanager
    def __call__(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
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
