"""`cachemgr serve`: the sidecar's lifecycle — scan, watch, apply, serve HTTP, shut down cleanly.

Start: bind the port first (a port in use is one line and exit 2, before any work), create the
root skeleton, open the DB, start the watcher and the index thread (the first scan runs there;
/readyz turns ready when it ends) and the GC thread (it deletes only while this process holds
the root's GC lock), then serve. SIGTERM/SIGINT: uvicorn stops accepting and finishes in-flight
requests (a second signal cuts that short, a third exits at once), GC stops after the chunk it
is deleting, the index thread applies its last batch, the DB is closed and the exit status is 0.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import signal
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

import uvicorn
from prometheus_client import CollectorRegistry

from cachemgr.daemon.api import PurgedNamespace, PurgeFn, PurgeRequest, PurgeResponse
from cachemgr.daemon.app import Backend, create_app
from cachemgr.daemon.indexer import Indexer, kernel_id, leadership_files
from cachemgr.daemon.metrics import CachemgrCollector
from cachemgr.errors import ConfigError, StateError
from cachemgr.fs.locks import root_lock
from cachemgr.fs.root import create_root
from cachemgr.fs.safe import refuse_non_regular
from cachemgr.gc.floor import open_freeing
from cachemgr.gc.policy import GcPolicy
from cachemgr.gc.runner import GcRunner, needs_gc
from cachemgr.layout import Layout
from cachemgr.ns import purge as purge_mod
from cachemgr.settings import Settings
from cachemgr.sglang.probe import ProbeLoop, ProbeState
from cachemgr.state.store import Store

log = logging.getLogger(__name__)
GC_STOP_SECONDS = 15.0  # a GC run stops after its current chunk; a trash entry may take longer


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
        why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound: {e.strerror}"
        raise ConfigError(f"port {port} on {host} {why}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def purge_function(layout: Layout, after: Callable[[], None]) -> PurgeFn:
    """Purge through cachemgr.ns.purge: rename now; `after` (wake GC) deletes .trash/ later."""

    def run(req: PurgeRequest) -> PurgeResponse:
        with Store.open(layout.db_path) as store:
            selector, targets, problems = (_would_purge if req.dry_run else _purge_now)(
                layout, store, req
            )
        if not req.dry_run:
            after()
        verb = "would purge" if req.dry_run else "purged"
        pages, size = sum(t.pages for t in targets), sum(t.bytes for t in targets)
        return PurgeResponse(
            dry_run=req.dry_run,
            selector=selector,
            purged=targets,
            pages=pages,
            bytes=size,
            message=f"{verb} {len(targets)} namespace(s): {pages} pages, {size} bytes",
            problems=problems,
        )

    return run


# A plan's selector, what it (would) purge, and what it left alone (damaged namespaces).
Targets = tuple[str, list[PurgedNamespace], list[str]]


def _would_purge(layout: Layout, store: Store, req: PurgeRequest) -> Targets:
    plan = _plan(layout, store, req)
    return (
        plan.selector,
        [
            PurgedNamespace(
                namespace=t.ns_id, pages=t.pages, bytes=t.bytes, recreated=bool(t.instances)
            )
            for t in plan.targets
        ],
        list(plan.problems),
    )


def _purge_now(layout: Layout, store: Store, req: PurgeRequest) -> Targets:
    """Plan and purge under one hold of the root lock: a purge racing this one (CLI, HTTP) is
    wholly before or after it, and the later one finds nothing left to do."""
    with root_lock(layout):
        plan = _plan(layout, store, req)
        result = purge_mod.execute_purge(plan, layout, store, actor="http", reason="manual")
    return (
        plan.selector,
        [
            PurgedNamespace(namespace=p.ns_id, pages=p.pages, bytes=p.bytes, recreated=p.recreated)
            for p in result.purged
        ],
        list(plan.problems),
    )


def _plan(layout: Layout, store: Store, req: PurgeRequest) -> purge_mod.PurgePlan:
    """One plan for the union of the request's selectors (none, or all=true: everything)."""
    if req.all or not (req.namespace or req.instance):
        return purge_mod.plan_purge(layout, store, all=True)
    plans = []
    if req.namespace:
        plans.append(purge_mod.plan_purge(layout, store, namespace=req.namespace))
    if req.instance:
        plans.append(purge_mod.plan_purge(layout, store, instance=req.instance))
    targets = {t.ns_id: t for p in plans for t in p.targets}
    return purge_mod.PurgePlan(
        tuple(targets[ns] for ns in sorted(targets)),
        plans[0].trash,
        " + ".join(p.selector for p in plans),
        problems=tuple(sorted({x for p in plans for x in p.problems})),
    )


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


class _Server(uvicorn.Server):
    """uvicorn without its signal handling: the daemon owns SIGTERM/SIGINT.

    uvicorn re-raises the signal it caught once its own shutdown ends, which kills the process
    before `Daemon.stop` can apply the last batch and close the DB.
    """

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


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
        self._signals = 0

    def start(self) -> None:
        """Bind, open the DB, start watching and indexing; returns before the first scan ends."""
        self.sock = bind_socket(self.settings.host, self.settings.port)
        try:  # a root refused (a planted link, say) must not leave the port bound
            create_root(self.layout)
            # Its threads take these locks later, where a refusal would only be a log line.
            refuse_non_regular(self.layout.lock_files(kernel_id()))
            self.gc_policy = GcPolicy.from_settings(self.settings)
            # Checked once: a DB damaged past its header is moved aside before anything reads it.
            self.store = open_freeing(self.layout, self.gc_policy, actor="auto", check=True)
        except BaseException:
            self.sock.close()
            raise
        self.reader = Reader(self.layout)
        leadership, ready_marker = leadership_files(self.layout)
        self.indexer = Indexer(
            self.store,
            self.layout,
            batch_interval=self.settings.batch_interval,
            reconcile_interval=self.settings.reconcile_interval or float("inf"),
            leadership=leadership,
            ready_marker=ready_marker,
        )
        self.indexer.on_error = self._index_failed
        self._start_gc()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(
            CachemgrCollector(
                self.layout,
                self.reader,
                index=self.indexer.state,
                lag=self.indexer.lag,
                probe=self.probe,
                gc=self.gc,
            )
        )
        self.backend = Backend(
            layout=self.layout,
            reader=self.reader,
            registry=self.registry,
            token=self.token,
            index=self.indexer.state,
            lag=self.indexer.lag,
            purge=purge_function(self.layout, self.gc.wake),
            after_purge=lambda _: self.indexer.request_rescan(),
            gc=self.gc,
        )
        self.app = create_app(self.backend)
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=10,
        )
        self.server = _Server(config)
        self.indexer.start()
        self._gc_thread.start()  # first cycle once the index is built; drains .trash/ too
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
        self._started = True
        log.info("daemon started", extra={"root": str(self.layout.root), "port": self.port})

    def _start_gc(self) -> None:
        """GC on its own thread and connection; the indexer wakes it past a watermark."""
        self.gc_store = Store.open(self.layout.db_path)
        # GC is led by an index leader: only its watcher wakes GC (watermarks, a CLI purge).
        self.gc = GcRunner(
            self.gc_store, self.layout, self.gc_policy, eligible=lambda: self.indexer.state.leader
        )
        self._gc_stop = threading.Event()
        self._gc_thread = threading.Thread(
            target=self.gc.serve,
            args=(self._gc_stop, self.indexer.state.ready),
            name="cachemgr-gc",
            daemon=True,
        )
        self.indexer.on_applied = self._check_watermarks
        # A CLI purge (or init --no-wait) renames into .trash/ from another process: GC
        # deletes it now rather than at the next interval.
        self.indexer.on_namespace_gone = lambda _ns: self.gc.wake()
        # A full disk stops index writes (they are retried): GC's floor pass frees it.
        self.indexer.on_disk_full = self.gc.wake

    def _check_watermarks(self) -> None:
        """After a batch (on the index thread, its connection): wake GC if a limit is crossed.

        Aggregate rows, one statvfs and a listing of .trash/: well under a millisecond, at most
        once per batch_interval. Not gated on leadership: a wake on a non-leader costs one
        flock attempt, and gating would drop a crossing seen before the lock is first taken.
        """
        reasons = needs_gc(self.store, self.layout, self.gc_policy, now=time.time())
        # Not for .trash/ alone: purges wake GC themselves, and an entry GC must refuse (a
        # symlink) would otherwise wake it on every batch; the interval retries it.
        if set(reasons) - {"trash"}:
            self.gc.wake()

    @property
    def port(self) -> int:
        assert self.sock is not None
        return int(self.sock.getsockname()[1])

    def serve(self) -> None:
        """Serve HTTP until a signal (or `server.should_exit`), then shut everything down."""
        assert self.sock is not None and self.server is not None
        with self._signal_handlers():
            try:
                self.server.run(sockets=[self.sock])
            finally:
                self.stop()
        if self.indexer.error is not None:
            raise StateError(f"the index writer failed: {self.indexer.error}")

    def _index_failed(self, error: BaseException) -> None:
        """On the index thread: a daemon whose index is dead must not look alive."""
        if self.server is not None:
            self.server.should_exit = True

    @contextmanager
    def _signal_handlers(self) -> Iterator[None]:
        """SIGTERM/SIGINT shut down cleanly, until `stop` ends (only the main thread can)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        """First signal: graceful shutdown; second: skip the waits; third: exit at once."""
        assert self.server is not None
        self._signals += 1
        if self._signals == 1:
            log.info("shutting down", extra={"signal": signal.Signals(sig).name})
            self.server.should_exit = True
        elif not self._started or self.server.force_exit:
            # Past uvicorn (waiting on GC or the index thread), or asked twice already: the DB
            # is WAL, so an abrupt exit loses at most the batch not yet applied.
            log.warning("forced exit", extra={"signal": signal.Signals(sig).name})
            os._exit(128 + sig)
        else:
            log.warning("forcing shutdown", extra={"signal": signal.Signals(sig).name})
            self.server.force_exit = True

    def _purge_mismatch(self, ns_id: str, diffs: list[str]) -> None:
        """The server contradicts its namespace: its pages may read back wrong, drop them now."""
        with Store.open(self.layout.db_path) as store:
            purge_mod.purge(self.layout, store, actor="auto", reason="mismatch", namespace=ns_id)
        log.error("purged namespace after identity mismatch", extra={"namespace": ns_id})
        self.gc.wake()

    def stop(self) -> None:
        """Finish the batch in flight, stop watching, close the DB (idempotent)."""
        if not self._started:
            return
        self._started = False
        if self.prober is not None:
            self.prober.stop()
        self._gc_stop.set()
        self.gc.wake()
        self._gc_thread.join(GC_STOP_SECONDS)
        if self._gc_thread.is_alive():  # a trash entry still being deleted; resumed next start
            log.warning("gc still deleting at shutdown; leaving it")
        else:
            self.gc_store.close()
        self.indexer.stop()
        self.reader.close()
        self.store.close()
        if self.sock is not None:
            self.sock.close()
        log.info("daemon stopped")
