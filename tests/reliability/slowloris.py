"""A slowloris client, run as its own process (its fds and its CPU are its own):

    python -m tests.reliability.slowloris PORT CONNECTIONS SECONDS

opens CONNECTIONS connections to 127.0.0.1:PORT and holds them for SECONDS, each with a request
head it never finishes; one the server closes stays closed. Prints one JSON line of counts.
"""

from __future__ import annotations

import errno
import json
import resource
import selectors
import socket
import sys
import time

PARTIAL_HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


class Flood:
    """Every connection is in one of two states: connecting, or holding a partial head."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sel = selectors.DefaultSelector()
        self.counts = {"opened": 0, "closed_by_server": 0, "connect_failed": 0, "max_held": 0}
        self.held = 0

    def open_one(self) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        err = sock.connect_ex(("127.0.0.1", self.port))
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            self.counts["connect_failed"] += 1
            return
        self.counts["opened"] += 1
        self.sel.register(sock, selectors.EVENT_WRITE, "connecting")

    def on_event(self, key: selectors.SelectorKey) -> None:
        sock: socket.socket = key.fileobj  # type: ignore[assignment]
        if key.data == "connecting":
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
                self.counts["connect_failed"] += 1
                self._drop(sock)
                return
            try:
                sock.send(PARTIAL_HEAD)
            except OSError:
                self._drop(sock, by_server=True)
                return
            self.held += 1
            self.counts["max_held"] = max(self.counts["max_held"], self.held)
            self.sel.modify(sock, selectors.EVENT_READ, "holding")
            return
        try:
            data = sock.recv(4096)
        except OSError:
            data = b""
        if not data:  # the server closed it (or answered and closed: counted the same)
            self.held -= 1
            self._drop(sock, by_server=True)

    def _drop(self, sock: socket.socket, by_server: bool = False) -> None:
        if by_server:
            self.counts["closed_by_server"] += 1
        self.sel.unregister(sock)
        sock.close()


def main() -> None:
    port, connections, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    flood = Flood(port)
    for _ in range(connections):
        flood.open_one()
    print(json.dumps({"ready": True}), flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for key, _ in flood.sel.select(timeout=0.2):
            flood.on_event(key)
    print(json.dumps({**flood.counts, "held_at_end": flood.held}), flush=True)


if __name__ == "__main__":
    main()
