"""`cachemgr serve`: the sidecar's lifecycle — scan, watch, apply, serve HTTP, shut down cleanly.

Start: bind the port first (a port in use is one line and exit 2, before any work), create the
root skeleton, open the DB, start the watcher and the index thread (the first scan runs there;
/readyz turns ready when it ends) and the GC thread (it deletes only while this process holds
the root's GC lock), then serve. SIGTERM/SIGINT: uvicorn stops accepting and finishes in-flight
requests (a second signal cuts that short, a third exits at once), GC stops after the chunk it
is deleting, the index thread applies its last batch, the DB is closed and the exit status is 0.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import uvicorn
from prometheus_client import CollectorRegistry

from cachemgr import engines
from cachemgr.daemon import heap, statewait
from cachemgr.daemon.app import create_app
from cachemgr.daemon.backend import Backend
from cachemgr.daemon.connections import raise_nofile_limit
from cachemgr.daemon.fleet import FleetCollector, FleetNode, build_fleet
from cachemgr.daemon.gcstate import DaemonGcState
from cachemgr.daemon.index_state import IndexState
from cachemgr.daemon.indexer import Indexer, IndexerConfig, IndexerHooks, IndexerShared
from cachemgr.daemon.metrics import CachemgrCollector, Parts
from cachemgr.daemon.purge_routes import purge_function
from cachemgr.daemon.refresher import Refresher
from cachemgr.daemon.serving import Reader, Server, bind_socket, is_loopback, uvicorn_config
from cachemgr.daemon.watcher import Watcher
from cachemgr.engine import Probe, ProbeHooks, ProbeState
from cachemgr.errors import ConfigError, StateError
from cachemgr.fleet.netfs import refuse_network_fs
from cachemgr.fs.leadership import index_files, kernel_id
from cachemgr.fs.root import create_root
from cachemgr.fs.safe import refuse_non_regular
from cachemgr.gc.chains import IN_FLIGHT, ChainModel
from cachemgr.gc.check import needs_gc
from cachemgr.gc.floor import open_freeing
from cachemgr.gc.keyfile import sweep_leftovers
from cachemgr.gc.policy import GcPolicy
from cachemgr.gc.runner import GcRunner
from cachemgr.ns import purge as purge_mod
from cachemgr.ns.bindings import qualify
from cachemgr.ns.manifest import format_of
from cachemgr.ns.quarantine import Quarantine
from cachemgr.ns.root import settings_layout
from cachemgr.settings import Settings
from cachemgr.state import busy, registry_sql
from cachemgr.state.store import Store
from cachemgr.worker import Worker

log = logging.getLogger(__name__)
GC_STOP_SECONDS = 15.0  # a GC run stops after its current chunk; a trash entry may take longer
PROBE_STOP_SECONDS = 10.0  # one poll's HTTP timeouts
MODEL_CLOSE_SECONDS = 5.0  # a thread that outlived its stop may hold the chain model
REFRESH_STOP_SECONDS = 10.0  # one snapshot of the DB (a few small queries)
FLEET_STOP_SECONDS = 10.0  # one coordinator request, one summary sent
HOLD_WAIT = 0.5  # seconds at most an index batch waits for a GC run holding a cap


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
        self.layout = settings_layout(settings)
        self.token = token
        self.probe: ProbeState | None = None  # the prober's, once built
        self.sock: socket.socket | None = None
        self.server: uvicorn.Server | None = None
        self.prober: Probe | None = None
        self._started = False
        self._signals = 0
        self.fleet: FleetNode | None = None

    def start(self) -> None:
        """Bind, open the DB, start watching and indexing; returns before the first scan ends."""
        self.nofile, _ = raise_nofile_limit()  # before anything opens a file
        self.sock = bind_socket(self.settings.host, self.settings.port)
        try:  # a root refused (a planted link, say) must not leave the port bound
            if self.settings.fleet_coordinator:  # SQLite's locks do not hold over NFS or FUSE
                refuse_network_fs(self.layout.state_dir)
            create_root(self.layout)
            # Its threads take these locks later, where a refusal would only be a log line.
            refuse_non_regular(self.layout.lock_files(kernel_id()))
            self.gc_policy = GcPolicy.from_settings(self.settings)
            # Checked once: a DB damaged past its header is moved aside before anything reads it.
            self.store = self._open_state()
        except BaseException:
            self.sock.close()
            raise
        self.reader = Reader(self.layout)
        self._build_workers()
        self.registry = CollectorRegistry(auto_describe=False)
        parts = Parts(
            index=self.indexer.state,
            lag=self.indexer.lag,
            probe=self.prober,
            gc=self.gc,
            workers=self.workers,
            quarantine=self.quarantine,
        )
        collector = CachemgrCollector(self.layout, self.reader, parts, cached=True)
        self.registry.register(collector)
        if self.fleet is not None:
            self.registry.register(FleetCollector(self.fleet))
        # Scrapes render a snapshot this thread keeps (cachemgr.daemon.refresher).
        self.refresher = Refresher(collector.refresh, on_death=self._worker_died)
        self.workers.append(self.refresher)
        self.gc_state.refresher = self.refresher  # kicked after each GC run
        self.backend = Backend(
            layout=self.layout,
            reader=self.reader,
            registry=self.registry,
            token=self.token,
            index=self.indexer.state,
            lag=self.indexer.lag,
            purge=purge_function(self.layout, self.gc.wake),
            after_purge=self._after_purge,
            gc=self.gc,
            settings=self.settings,
            workers=self.workers,
            quarantine=self.quarantine,
            fleet=self.fleet,
        )
        self.app = create_app(self.backend)
        self.server = Server(uvicorn_config(self.app, self.settings, self.nofile, self.registry))
        heap.start_serving()  # all of the above lives as long as the daemon: out of GC's way
        for worker in self.workers:  # GC's first cycle waits for the index; drains .trash/ too
            worker.start()
        self._started = True
        log.info("daemon started", extra={"root": str(self.layout.root), "port": self.port})

    def _open_state(self) -> Store:
        """The state DB; one another process keeps shut is waited for while HTTP says so."""

        def opener() -> Store:
            return open_freeing(self.layout, self.gc_policy, actor="auto", check=True)

        assert self.sock is not None
        db = self.layout.db_path
        if not busy.shuts_out_readers(db):
            try:
                return opener()
            except StateError as e:
                if not statewait.locked(e):
                    raise
        return statewait.open_when_free(db, opener, self.settings, self.sock, self.nofile)

    def _build_workers(self) -> None:
        """The index writer, GC (its own thread and connection) and the engine's probe, each
        built after what it reads: the state they share first (uvicorn's `ServerState`)."""
        self.quarantine = Quarantine()  # what the index and GC found they cannot use
        index = IndexState()
        sweep_leftovers(self.layout.state_dir)  # (key files of a process killed as it made one)
        model = ChainModel(
            lambda ns: format_of(self.layout, ns),
            in_flight=IN_FLIGHT,
            key_dir=self.layout.state_dir,  # (the page keys' file: on disk, beside the DB)
        )
        watcher = Watcher(self.layout)
        self.gc_state = DaemonGcState(index, watcher, model, self.reader, self.quarantine)
        self.gc_store = Store.open(self.layout.db_path)
        # Fleet mode: GC leads (deletes) only while this node holds the fleet's lease.
        self.fleet = None
        if self.settings.fleet_coordinator:
            self.fleet = build_fleet(
                self.settings,
                self.layout,
                self.port,
                on_elected=self.gc_state.woken.set,
                on_death=self._worker_died,
            )
        self.gc = GcRunner(
            self.layout,
            self.gc_store,
            self.gc_policy,
            live=self.gc_state,
            on_death=self._worker_died,
            leadership=self.fleet.leadership if self.fleet is not None else None,
        )
        leadership, ready_marker = index_files(self.layout)
        self.indexer = Indexer(
            self.layout,
            self.store,
            IndexerConfig(
                batch_interval=self.settings.batch_interval,
                reconcile_interval=self.settings.reconcile_interval or float("inf"),
                leadership=leadership,
                ready_marker=ready_marker,
            ),
            IndexerShared(
                watcher=watcher,
                state=index,
                model=model,
                backlog=self.gc_state.backlog,
                quarantine=self.quarantine,
            ),
            IndexerHooks(
                on_applied=self._check_watermarks,
                # A CLI purge (or init --no-wait) renames into .trash/ from another process:
                # GC deletes it now rather than at the next interval.
                on_namespace_gone=self._namespace_gone,
                # A full disk stops index writes (they are retried): GC's floor pass frees it.
                on_disk_full=self.gc.wake,
                # GC holding a cap needs the one GIL more than the index does (it takes the
                # stores not applied yet): a batch waits for its run, a bounded time.
                before_batch=lambda: self.gc.not_holding.wait(HOLD_WAIT),
            ),
            on_death=self._worker_died,
        )
        # The engine whose server the settings name watches it (cachemgr.engines).
        self.prober = engines.probe(
            self.settings,
            ProbeHooks(
                instance=qualify(self.layout, self.settings.instance),
                bound=self._bound_namespace,
                on_mismatch=self._purge_mismatch,
                on_death=self._worker_died,
            ),
        )
        self.probe = self.prober.state if self.prober is not None else None
        self.workers: list[Worker] = [self.indexer, self.gc, *filter(None, [self.prober])]
        if self.fleet is not None:
            self.fleet.watch(watcher)
            self.workers += self.fleet.workers

    def _bound_namespace(self, instance: str) -> tuple[str, str, int] | None:
        """The prober's lookup: (id, identity_json, indexed pages) of the instance's namespace."""
        with self.reader() as conn:
            return registry_sql.bound_namespace(conn, instance)

    def _after_purge(self, _: object) -> None:
        self.indexer.request_rescan()
        self.refresher.kick()

    def _namespace_gone(self, _ns: str) -> None:
        self.gc.wake()
        self.refresher.kick()

    def _check_watermarks(self) -> None:
        """After a batch (on the index thread, its connection): wake GC if a limit is crossed.

        Aggregate rows, one statvfs and a listing of .trash/: well under a millisecond, at most
        once per batch_interval. Not gated on leadership: a wake on a non-leader costs one
        flock attempt, and gating would drop a crossing seen before the lock is first taken.
        """
        reasons = needs_gc(
            self.layout,
            self.store,
            self.gc_policy,
            now=time.time(),
            disk_usage=self.gc.disk_usage,
            ahead=self.gc.ahead(),
            pending=self.gc_state.backlog.bytes(),
        )
        self.gc_state.rearm(self.store.conn, self.gc)
        # Not for .trash/ alone: purges wake GC themselves, and an entry GC must refuse (a
        # symlink) would otherwise wake it on every batch; the interval retries it.
        if set(reasons) - {"trash"}:
            self.gc.wake()
        self.refresher.kick()

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

    def _worker_died(self, worker: Worker) -> None:
        """On the dead worker's thread (it logged why): /readyz and cachemgr_worker_up say so.
        A daemon whose index is dead must not look alive: it exits non-zero."""
        if worker is self.indexer and self.server is not None:
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
            self.prober.stop(PROBE_STOP_SECONDS)
        if self.gc.stop(GC_STOP_SECONDS):
            self.gc_store.close()
        else:  # still deleting a trash entry (resumed next start): it may change the index
            log.warning("gc still deleting at shutdown; leaving it")
            self.indexer.save_model = False  # so no model snapshot (cachemgr.gc.modelfile)
        if self.fleet is not None:  # after GC: the lease is handed over once GC stopped
            for worker in self.fleet.workers:
                worker.stop(FLEET_STOP_SECONDS)
        self.indexer.stop()
        if not self.gc_state.flight.model.close(MODEL_CLOSE_SECONDS):
            log.warning("chain model still in use at shutdown; its key file left open")
        self.refresher.stop(REFRESH_STOP_SECONDS)
        self.reader.close()
        self.store.close()
        if self.sock is not None:
            self.sock.close()
        heap.stop_serving()
        log.info("daemon stopped")
