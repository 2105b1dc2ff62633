"""Helpers for the daemon tests: page files written the way SGLang writes them, a running
daemon on a loopback port."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from cachemgr.daemon.lifecycle import Daemon
from cachemgr.gc.chains import BURST_GAP
from cachemgr.layout import Layout
from cachemgr.logs import JsonFormatter
from cachemgr.ns.registry import bind, ensure_namespace
from cachemgr.settings import Settings
from cachemgr.state.store import Store
from tests.polling import wait_for

NS_A = "0123456789abcdef"
NS_B = "fedcba9876543210"


def cli_argv(root: Path | str) -> list[str]:
    """`cachemgr --root ROOT` in a subprocess of this interpreter, logging errors only: a
    command's argv starts so."""
    return [sys.executable, "-m", "cachemgr", "--root", str(root), "--log-level", "error"]


def page_name(i: int, model: str = "Qwen-Qwen3-8B") -> str:
    return f"{i:064x}_{model}_0_1.bin"


def store_page(ns_dir: Path, name: str, size: int = 1024, mtime: float | None = None) -> None:
    """Store a page like SGLang's HiCacheFile.set: a `.<uuid>.tmp` file, then os.replace;
    `mtime`: the file's, set before the rename (the writer's clock, as the watcher reads it)."""
    tmp = ns_dir / f".{uuid.uuid4().hex}.tmp"
    with open(tmp, "wb") as f:
        f.write(b"\x01" * size)
    if mtime is not None:
        os.utime(tmp, (mtime, mtime))
    os.replace(tmp, ns_dir / name)


def store_burst(ns_dir: Path, names: list[str], size: int = 1024) -> None:
    """Store one request's pages back to back, as SGLang's batch_set does: by their files'
    mtimes BURST_GAP / 10 apart. The chain model links a store to the one before only within
    BURST_GAP (cachemgr.gc.chains); a test's writer shares the GIL with the daemon it runs and
    the CPU with CI's load, and a pause longer than that between two of its stores split a
    request's chain, which the learner is right not to link (the tests then failed)."""
    t0 = time.time()
    for i, name in enumerate(names):
        store_page(ns_dir, name, size, mtime=t0 + i * BURST_GAP / 10)


def read_page(ns_dir: Path, name: str) -> None:
    """Read a page like HiCacheFile.get: open, read, close."""
    with open(ns_dir / name, "rb") as f:
        f.read()


class RunningDaemon:
    """A daemon serving on a loopback port in a thread, and an httpx client for it."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.url = f"http://127.0.0.1:{daemon.port}"
        self.http = httpx.Client(base_url=self.url, timeout=10)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return self.http.get(path, **kw)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        return self.http.post(path, **kw)

    def status(self) -> dict[str, Any]:
        r = self.get("/v1/status")
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data

    def namespaces(self) -> dict[str, dict[str, Any]]:
        return {ns["id"]: ns for ns in self.status()["namespaces"]}


@contextmanager
def running_daemon(settings: Settings) -> Iterator[RunningDaemon]:
    """Start the real daemon (uvicorn on 127.0.0.1, port 0) and wait until it is ready and
    its GC may run (a daemon is ready before it loads GC's model, or scans what changed while
    it was down)."""
    daemon = Daemon(settings.model_copy(update={"port": 0}))
    daemon.start()
    thread = threading.Thread(target=daemon.serve, name="test-uvicorn", daemon=True)
    thread.start()
    running = RunningDaemon(daemon)
    try:
        wait_for(lambda: _ready(running), bool, timeout=30)
        wait_for(lambda: _first_tick_done(daemon), bool, timeout=30, what="GC's first tick")
        yield running
    finally:
        running.http.close()
        if daemon.server is not None:
            daemon.server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "daemon did not shut down"


async def asgi_get(app: FastAPI, path: str) -> httpx.Response:
    """GET `path` of an app in this process (no server): `anyio.run(asgi_get, app, path)`."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        return await c.get(path)


def settled(ready: httpx.Response) -> bool:
    """A /readyz answer of a daemon that is ready and whose GC may run (a daemon is ready
    before it loads GC's model, or scans what changed while it was down)."""
    return ready.status_code == 200 and "GC starts after" not in ready.json()["detail"]


def _first_tick_done(daemon: Daemon) -> bool:
    """GC's first tick, at once after ready, has taken the GC lock (an fd the daemon keeps
    open until it stops) or found another process leading: a test that starts after it does
    not see that fd as one it leaked."""
    gc = daemon.gc
    return gc.leadership.held or gc.stats.skipped > 0 or gc.stats.error > 0


def _ready(running: RunningDaemon) -> bool:
    try:
        return settled(running.get("/readyz"))
    except httpx.TransportError:
        return False


IDENTITY = {
    "kv_cache_dtype": "bfloat16",
    "page_size": 64,
    "source": {
        "served_model_name": "Qwen/Qwen3-8B",
        "model_path": "/models/Qwen3-8B",
        "model_dir": "/models/Qwen3-8B",
        "kv_cache_dtype_arg": "auto",
    },
}


def register_namespace(
    layout: Layout, ns_id: str, instance: str | None = None, identity: dict[str, Any] | None = None
) -> Path:
    """Create ns/<id>/ with a manifest and a registry row, as `cachemgr init` does."""
    store = Store.open(layout.db_path)
    try:
        ensure_namespace(
            layout,
            store,
            ns_id=ns_id,
            digest=ns_id * 2,
            identity=identity or IDENTITY,
            now=time.time(),
        )
        if instance is not None:
            with store.transaction():
                bind(layout, store, instance, ns_id, time.time())
    finally:
        store.close()
    return layout.ns_dir(ns_id)


class LogLines(logging.Handler):
    """Log records as the daemon's JSON formatter writes them."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter())
        self.lines: list[dict[str, object]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@contextmanager
def captured_log(name: str) -> Iterator[LogLines]:
    """The INFO and higher lines logger `name` writes meanwhile."""
    logger, handler = logging.getLogger(name), LogLines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
