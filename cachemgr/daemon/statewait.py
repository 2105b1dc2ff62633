"""Serving while the start waits for a state DB that another process keeps shut.

A foreign connection in `locking_mode=EXCLUSIVE` (a backup tool, a person's `sqlite3` shell)
shuts out even readers, for as long as it likes. The daemon cannot open its DB then, but a
supervisor that sees no `/healthz` restarts it for ever: so the bound socket serves a small
app (live, not ready, the lock's holder named, `/metrics`) until the DB opens, and the start
then goes on as usual on the same socket.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cachemgr.daemon.metrics import METRICS
from cachemgr.daemon.problems import PROBLEM
from cachemgr.daemon.serving import Server, uvicorn_config
from cachemgr.errors import StateError
from cachemgr.settings import Settings
from cachemgr.state import busy
from cachemgr.state.store import Store

log = logging.getLogger(__name__)
RETRY_SECONDS = 0.5  # between looks at the lock: the start goes on this soon after it goes


class StateWait:
    """The DB the start is waiting for, and what the waiting app says about it."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.since = time.monotonic()
        self.holder = busy.describe_holders(db)
        self.stop = threading.Event()  # a signal: the start gives up, the process exits

    def detail(self) -> str:
        """What /readyz says: the DB, its holder, and for how long."""
        return (
            f"state DB {self.db} locked by {self.holder} for "
            f"{time.monotonic() - self.since:.0f} s; the daemon starts once it is released"
        )


def locked(error: StateError) -> bool:
    """Whether opening the DB failed only because another connection holds it."""
    return busy.is_locked(error.__cause__) if error.__cause__ else False


def open_when_free(
    db: Path, opener: Callable[[], Store], settings: Settings, sock: socket.socket, nofile: int
) -> Store:
    """Serve the waiting app on `sock` until `opener` gets past the lock on `db`; its Store.
    SIGTERM/SIGINT meanwhile end the process with status 0: it never started."""
    wait = StateWait(db)
    log.warning(
        "state DB locked by another process; serving /healthz until it is released",
        extra={"db": str(db), "holder": wait.holder},
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_WaitMetrics(wait))
    server = Server(uvicorn_config(_app(wait, registry), settings, nofile, registry))
    # A duplicate: uvicorn closes the sockets it served on, and the daemon serves on after it.
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock.dup()]}, name="state-wait-http"
    )
    thread.start()
    try:
        with _stopping_on_signal(wait):
            store = _retry(opener, wait)
    finally:
        server.should_exit = True
        thread.join()
    log.info("state DB released; starting", extra={"db": str(db)})
    return store


def _retry(opener: Callable[[], Store], wait: StateWait) -> Store:
    """`opener` once readers get in, again while the lock comes back; exit 0 on a signal."""
    while True:
        if wait.stop.wait(RETRY_SECONDS):
            log.info("stopped while waiting for the state DB")
            raise SystemExit(0)
        if busy.shuts_out_readers(wait.db):
            wait.holder = busy.describe_holders(wait.db)
            continue
        try:
            return opener()
        except StateError as e:
            if not locked(e):
                raise


@contextmanager
def _stopping_on_signal(wait: StateWait) -> Iterator[None]:
    """SIGTERM/SIGINT set `wait.stop` (only the main thread can take signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(sig: int, frame: FrameType | None) -> None:
        wait.stop.set()

    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, stop) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _app(wait: StateWait, registry: CollectorRegistry) -> Starlette:
    """Live, not ready, metrics; every other route a 503 saying why."""

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        return JSONResponse({"ready": False, "detail": wait.detail()}, status_code=503)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def starting(request: Request) -> Response:
        body = {
            "type": "about:blank",
            "title": "starting",
            "status": 503,
            "detail": wait.detail(),
            "instance": request.url.path,
        }
        return JSONResponse(body, status_code=503, media_type=PROBLEM)

    return Starlette(
        routes=[
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            Route("/metrics", metrics),
            Route("/{path:path}", starting, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
        ]
    )


class _WaitMetrics:
    """The few series that mean something before the DB opens."""

    def __init__(self, wait: StateWait) -> None:
        self.wait = wait

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("cachemgr_up", METRICS["cachemgr_up"], value=1)
        yield GaugeMetricFamily("cachemgr_ready", METRICS["cachemgr_ready"], value=0)
        name = "cachemgr_index_settled"
        yield GaugeMetricFamily(name, METRICS[name], value=0)
        name = "cachemgr_state_db_locked"
        yield GaugeMetricFamily(name, METRICS[name], value=1)
