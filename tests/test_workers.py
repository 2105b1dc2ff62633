"""A worker thread that dies marks the daemon unhealthy: /readyz 503 naming it,
cachemgr_worker_up{worker} 0, one log line; it never vanishes silently."""

from __future__ import annotations

import logging
from typing import Any, NoReturn

import anyio
import httpx
import pytest
from prometheus_client import CollectorRegistry

from cachemgr.daemon.app import create_app
from cachemgr.daemon.backend import Backend
from cachemgr.daemon.metrics import CachemgrCollector, Parts
from cachemgr.daemon.serving import Reader
from cachemgr.gc.policy import GcPolicy
from cachemgr.gc.runner import GcRunner, LiveState
from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from cachemgr.state.store import Store
from cachemgr.worker import Worker
from tests.daemon_helpers import (
    NS_A,
    asgi_get,
    page_name,
    register_namespace,
    running_daemon,
    store_page,
)
from tests.polling import wait_for
from tests.test_server import metric
from tests.test_sglang_probe import fake_sglang  # noqa: F401 (a fixture)


def died_lines(caplog: pytest.LogCaptureFixture, worker: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.getMessage() == "worker died" and getattr(r, "worker", None) == worker
    ]


def test_a_dead_probe_fails_readyz_and_its_metric_on_the_real_daemon(
    layout: Layout,
    fake_sglang: tuple[str, dict[str, Any]],  # noqa: F811 (the fixture imported above)
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server contradicts its namespace, and the purge that follows fails (the manifest
    became unreadable meanwhile): an error the probe cannot survive, on its own thread."""
    url, info = fake_sglang
    d = register_namespace(layout, NS_A, instance="gpu0")
    for i in range(3):
        store_page(d, page_name(i))
    settings = load_settings(
        root=layout.root, sglang_url=url, sglang_poll_interval=0.05, instance="gpu0"
    )
    caplog.set_level(logging.ERROR, logger="cachemgr.worker")
    with running_daemon(settings) as dm:
        wait_for(lambda: metric(dm.get("/metrics").text, "cachemgr_sglang_up"), lambda v: v == 1)
        assert metric(dm.get("/metrics").text, "cachemgr_worker_up", worker="probe") == 1
        layout.manifest(NS_A).write_text("{not json")  # purge leaves a damaged namespace alone
        info["kv_cache_dtype"] = "fp8_e4m3"
        ready = wait_for(lambda: dm.get("/readyz"), lambda r: r.status_code == 503)
        assert "probe worker died" in ready.json()["detail"]
        text = dm.get("/metrics").text
        assert metric(text, "cachemgr_worker_up", worker="probe") == 0
        assert metric(text, "cachemgr_worker_up", worker="index") == 1
        assert metric(text, "cachemgr_sglang_up") == 0  # not the last scrape's stale 1
        assert len(died_lines(caplog, "probe")) == 1


class Broken(Exception):
    """What no loop of cachemgr's expects: it must end the thread, loudly."""


class NeverEligible(LiveState):
    def may_lead(self) -> bool:
        raise Broken("may_lead() is broken")


def test_a_dead_gc_thread_fails_readyz_and_its_metric(
    layout: Layout, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="cachemgr.worker")
    died: list[Worker] = []
    runner = GcRunner(layout, store, GcPolicy(), live=NeverEligible(), on_death=died.append)
    reader = Reader(layout)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CachemgrCollector(layout, reader, Parts(workers=[runner])))
    app = create_app(Backend(layout=layout, reader=reader, registry=registry, workers=[runner]))
    try:
        assert registry.get_sample_value("cachemgr_worker_up", {"worker": "gc"}) == 1
        runner.start()  # its first tick asks may_lead()
        wait_for(lambda: died, bool)
        assert died == [runner] and isinstance(runner.error, Broken)
        assert registry.get_sample_value("cachemgr_worker_up", {"worker": "gc"}) == 0
        ready = anyio.run(asgi_get, app, "/readyz")
        assert ready.status_code == 503 and "gc worker died" in ready.json()["detail"]
        assert len(died_lines(caplog, "gc")) == 1
    finally:
        assert runner.stop(5)
        reader.close()


def test_an_unexpected_error_in_a_route_is_a_problem_json_500(layout: Layout) -> None:
    def purge(_: object) -> NoReturn:
        raise Broken("the purge function is broken")

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post("/v1/purge", json={"all": True})

    reader = Reader(layout)
    app = create_app(
        Backend(layout=layout, reader=reader, registry=CollectorRegistry(), purge=purge)
    )
    try:
        r = anyio.run(post)
    finally:
        reader.close()
    assert r.status_code == 500 and r.headers["content-type"] == "application/problem+json"
    assert r.json()["title"] == "internal error" and "broken" not in r.text.lower()
