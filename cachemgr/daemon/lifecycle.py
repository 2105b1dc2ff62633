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
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import uvicorn
from prometheus_client import CollectorRegistry

from cachemgr.daemon import heap
from cachemgr.daemon.app import create_app
from cachemgr.daemon.backend import Backend
from cachemgr.daemon.backlog import Flight, StoreBacklog
from cachemgr.daemon.connections import raise_nofile_limit
from cachemgr.daemon.index_leader import kernel_id, leadership_files
from cachemgr.daemon.index_state import IndexState
from cachemgr.daemon.indexer import Indexer
from cachemgr.daemon.metrics import CachemgrCollector
from cachemgr.daemon.purge_routes import purge_function
from cachemgr.daemon.refresher import Refresher
from cachemgr.daemon.serving import Reader, Server, bind_socket, is_loopback, uvicorn_config
from cachemgr.errors import ConfigError, StateError
from cachemgr.fs.root import create_root
from cachemgr.fs.safe import refuse_non_regular
from cachemgr.gc.chains import IN_FLIGHT, ChainModel
from cachemgr.gc.check import needs_gc, room
from cachemgr.gc.floor import open_freeing
from cachemgr.gc.policy import GcPolicy
from cachemgr.gc.runner import GcRunner
from cachemgr.layout import Layout
from cachemgr.ns import purge as purge_mod
from cachemgr.ns.manifest import format_of
from cachemgr.ns.quarantine import Quarantine
from cachemgr.settings import Settings
from cachemgr.sglang.probe import ProbeLoop, ProbeState
from cachemgr.state import registry_sql
from cachemgr.state.store import Store
from cachemgr.worker import Worker

log = logging.getLogger(__name__)
GC_STOP_SECONDS = 15.0  # a GC run stops after its current chunk; a trash entry may take longer
PROBE_STOP_SECONDS = 10.0  # one poll's HTTP timeouts
REFRESH_STOP_SECONDS = 10.0  # one snapshot of the DB (a few small queries)


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
        self.prober: ProbeLoop | None = None
        self._started = False
        self._signals = 0

    def start(self) -> None:
        """Bind, open the DB, start watching and indexing; returns before the first scan ends."""
        self.nofile, _ = raise_nofile_limit()  # before anything opens a file
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
        self._build_workers()
        self.registry = CollectorRegistry(auto_describe=False)
        collector = CachemgrCollector(
            self.layout, self.reader, index=self.indexer.state, lag=self.indexer.lag,
            probe=self.probe, gc=self.gc, workers=self.workers, cached=True,
            quarantine=self.quarantine,
        )  # fmt: skip
        self.registry.register(collector)
        # Scrapes render a snapshot this thread keeps (cachemgr.daemon.refresher).
        self.refresher = Refresher(collector.refresh, on_death=self._worker_died)
        self.workers.append(self.refresher)
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
        )
        self.app = create_app(self.backend)
        self.server = Server(uvicorn_config(self.app, self.settings, self.nofile, self.registry))
        heap.start_serving()  # all of the above lives as long as the daemon: out of GC's way
        for worker in self.workers:  # GC's first cycle waits for the index; drains .trash/ too
            worker.start()
        self._started = True
        log.info("daemon started", extra={"root": str(self.layout.root), "port": self.port})

    def _build_workers(self) -> None:
        """The index writer, GC (its own thread and connection) and the SGLang probe, wired
        to each other; not started."""
        index = IndexState()
        self.quarantine = Quarantine()  # what the index and GC found they cannot use
        model = ChainModel(lambda ns: format_of(self.layout, ns), in_flight=IN_FLIGHT)
        # Stores not applied yet: GC counts them; past the room left, the watcher wakes GC.
        self.backlog = StoreBacklog(wake=lambda: self.gc.wake())
        self.gc_store = Store.open(self.layout.db_path)
        # GC is led by an index leader: only its watcher wakes GC (watermarks, a CLI purge).
        self.gc = GcRunner(
            self.layout, self.gc_store, self.gc_policy, eligible=lambda: index.leader,
            ready=index.ready, model=model, on_death=self._worker_died,
            # Written while a run frees room; what the index has not applied: counted, not guessed.
            ahead=lambda: int(index.write_rate * self.gc.run_seconds),
            pending=self.backlog.bytes,
            in_flight=lambda: self.flight(),
            after_run=self._rearm,
            quarantine=self.quarantine,
        )  # fmt: skip
        leadership, ready_marker = leadership_files(self.layout)
        self.indexer = Indexer(
            self.layout,
            self.store,
            batch_interval=self.settings.batch_interval,
            reconcile_interval=self.settings.reconcile_interval or float("inf"),
            leadership=leadership,
            ready_marker=ready_marker,
            state=index,
            model=model,
            backlog=self.backlog,
            on_applied=self._check_watermarks,
            # A CLI purge (or init --no-wait) renames into .trash/ from another process: GC
            # deletes it now rather than at the next interval.
            on_namespace_gone=self._namespace_gone,
            # A full disk stops index writes (they are retried): GC's floor pass frees it.
            on_disk_full=self.gc.wake,
            quarantine=self.quarantine,
            on_death=self._worker_died,
        )
        self.flight = Flight(self.indexer.watcher, model)
        if self.probe is not None and self.settings.sglang_url:
            self.prober = ProbeLoop(
                self.settings.sglang_url,
                instance=self.settings.instance,
                bound=self._bound_namespace,
                on_mismatch=self._purge_mismatch,
                interval=self.settings.sglang_poll_interval,
                state=self.probe,
                on_death=self._worker_died,
            )
        self.workers: list[Worker] = [self.indexer, self.gc, *filter(None, [self.prober])]

    def _bound_namespace(self, instance: str) -> tuple[str, str, int] | None:
        """The prober's lookup: (id, identity_json, indexed pages) of the instance's namespace."""
        with self.reader() as conn:
            return registry_sql.bound_namespace(conn, instance)

    def _rearm(self) -> None:
        """After a GC run (on its thread): the room it left, so the watcher wakes GC again
        without waiting for the index's next batch; and the heap its plan freed, given back."""
        with self.reader() as conn:
            self._set_room(conn)
        self.refresher.kick()
        heap.trim()  # (well under a ms, without the GIL: bench/RESULTS.md)

    def _set_room(self, conn: sqlite3.Connection) -> None:
        """What the watcher may see stored before it wakes GC itself."""
        self.backlog.rearm(room(
            self.layout, conn, self.gc_policy, disk_usage=self.gc.disk_usage, ahead=self.gc.ahead()
        ))  # fmt: skip

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
            self.layout, self.store, self.gc_policy, now=time.time(),
            disk_usage=self.gc.disk_usage, ahead=self.gc.ahead(), pending=self.backlog.bytes(),
        )  # fmt: skip
        self._set_room(self.store.conn)
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
        self.indexer.stop()
        self.refresher.stop(REFRESH_STOP_SECONDS)
        self.reader.close()
        self.store.close()
        if self.sock is not None:
            self.sock.close()
        heap.stop_serving()
        log.info("daemon stopped")
