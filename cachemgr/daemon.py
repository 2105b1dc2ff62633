"""`cachemgr serve`: the sidecar's lifecycle — scan, watch, apply, serve HTTP, shut down cleanly.

Start: bind the port first (a port in use is one line and exit 2, before any work), create the
root skeleton, open the DB, start the watcher and the index thread (the first scan runs there;
/readyz turns ready when it ends), then serve. SIGTERM/SIGINT: uvicorn stops accepting and
finishes in-flight requests (a second signal forces it), then the index thread applies its last
batch and the DB is closed.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from prometheus_client import CollectorRegistry

from cachemgr import purge as purge_mod
from cachemgr.deletion import Pacer
from cachemgr.errors import ConfigError
from cachemgr.indexer import Indexer
from cachemgr.layout import Layout
from cachemgr.metrics import CachemgrCollector
from cachemgr.server import (
    Backend,
    PurgedNamespace,
    PurgeFn,
    PurgeRequest,
    PurgeResponse,
    create_app,
)
from cachemgr.settings import Settings
from cachemgr.sglang_probe import ProbeLoop, ProbeState
from cachemgr.store import Store, connect

log = logging.getLogger(__name__)


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
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound: {e.strerror}"
        raise ConfigError(f"port {port} on {host} {why}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def purge_function(layout: Layout, settings: Settings) -> PurgeFn:
    """Purge through cachemgr.purge: rename now, delete in a paced background thread."""

    def run(req: PurgeRequest) -> PurgeResponse:
        everything = not (req.namespace or req.instance)
        store = Store.open(layout.db_path)
        try:
            plan = purge_mod.plan_purge(
                layout, store, namespace=req.namespace, instance=req.instance, all=everything
            )
            if not req.dry_run:
                purge_mod.execute_purge(plan, layout, store, actor="http", reason="manual")
        finally:
            store.close()
        if not req.dry_run:
            drain_trash_later(layout, settings)
        targets = [
            PurgedNamespace(
                namespace=t.ns_id, pages=t.pages, bytes=t.bytes, recreated=bool(t.instances)
            )
            for t in plan.targets
        ]
        verb = "would purge" if req.dry_run else "purged"
        pages, size = plan.pages, plan.bytes
        return PurgeResponse(
            dry_run=req.dry_run,
            selector=plan.selector,
            purged=targets,
            pages=pages,
            bytes=size,
            message=f"{verb} {len(targets)} namespace(s): {pages} pages, {size} bytes",
        )

    return run


@dataclass
class _Drainer:
    """One background deletion of .trash/ at a time; a purge during it queues one more run."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    thread: threading.Thread | None = None
    pending: bool = False


_drainer = _Drainer()


def drain_trash_later(layout: Layout, settings: Settings) -> None:
    """Delete what purges left in .trash/, paced, in a background thread."""
    with _drainer.lock:
        if _drainer.thread is not None and _drainer.thread.is_alive():
            _drainer.pending = True  # that run listed .trash/ before this purge
            return
        if not purge_mod.list_trash(layout):
            return

        def done(_: object) -> None:
            with _drainer.lock:
                again, _drainer.pending, _drainer.thread = _drainer.pending, False, None
            if again:
                drain_trash_later(layout, settings)

        _drainer.thread = purge_mod.drain_in_background(
            layout, actor="auto", pacer=Pacer(rate=settings.trash_delete_rate), on_done=done
        )


class Reader:
    """One read connection shared by HTTP threads and scrapes (sqlite3 objects need a lock)."""

    def __init__(self, layout: Layout) -> None:
        self._conn = connect(layout.db_path)
        self._lock = threading.Lock()

    @contextmanager
    def __call__(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self._conn

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class Daemon:
    """The running sidecar; `start()` then `serve()` (blocking) or `stop()`."""

    def __init__(self, settings: Settings) -> None:
        token = settings.token.get_secret_value() if settings.token else None
        if not token and not is_loopback(settings.host):
            raise ConfigError(
                f"refusing to serve on {settings.host} without a token: set token "
                "(env CACHEMGR_TOKEN) or bind 127.0.0.1"
            )
        self.settings = settings
        self.layout = Layout.at(settings.root, settings.state_dir)
        self.token = token
        self.probe = ProbeState() if settings.sglang_url else None
        self.sock: socket.socket | None = None
        self.server: uvicorn.Server | None = None
        self._started = False

    def start(self) -> None:
        """Bind, open the DB, start watching and indexing; returns before the first scan ends."""
        self.sock = bind_socket(self.settings.host, self.settings.port)
        self.layout.ensure()
        self.store = Store.open(self.layout.db_path)
        self.reader = Reader(self.layout)
        self.indexer = Indexer(
            self.store,
            self.layout,
            batch_interval=self.settings.batch_interval,
            reconcile_interval=self.settings.reconcile_interval or float("inf"),
        )
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(
            CachemgrCollector(
                self.layout,
                self.reader,
                index=self.indexer.state,
                lag=self.indexer.lag,
                probe=self.probe,
            )
        )
        self.backend = Backend(
            layout=self.layout,
            reader=self.reader,
            registry=self.registry,
            token=self.token,
            index=self.indexer.state,
            lag=self.indexer.lag,
            purge=purge_function(self.layout, self.settings),
            after_purge=lambda _: self.indexer.request_rescan(),
        )
        self.app = create_app(self.backend)
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=10,
        )
        self.server = uvicorn.Server(config)
        self.indexer.start()
        if self.probe is not None and self.settings.sglang_url:
            self.prober: ProbeLoop | None = ProbeLoop(
                self.settings.sglang_url,
                instance=self.settings.instance,
                reader=self.reader,
                on_mismatch=self._purge_mismatch,
                interval=self.settings.sglang_poll_interval,
                state=self.probe,
            )
            self.prober.start()
        else:
            self.prober = None
        drain_trash_later(self.layout, self.settings)  # what a crash or a CLI purge left
        self._started = True
        log.info("daemon started", extra={"root": str(self.layout.root), "port": self.port})

    @property
    def port(self) -> int:
        assert self.sock is not None
        return int(self.sock.getsockname()[1])

    def serve(self) -> None:
        """Serve HTTP until a signal (or `server.should_exit`), then shut everything down."""
        assert self.sock is not None and self.server is not None
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.stop()

    def _purge_mismatch(self, ns_id: str, diffs: list[str]) -> None:
        """The server contradicts its namespace: its pages may read back wrong, drop them now."""
        store = Store.open(self.layout.db_path)
        try:
            purge_mod.purge(self.layout, store, actor="auto", reason="mismatch", namespace=ns_id)
        finally:
            store.close()
        log.error("purged namespace after identity mismatch", extra={"namespace": ns_id})
        drain_trash_later(self.layout, self.settings)

    def stop(self) -> None:
        """Finish the batch in flight, stop watching, close the DB (idempotent)."""
        if not self._started:
            return
        self._started = False
        if self.prober is not None:
            self.prober.stop()
        self.indexer.stop()
        self.reader.close()
        self.store.close()
        if self.sock is not None:
            self.sock.close()
        log.info("daemon stopped")
