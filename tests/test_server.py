"""The HTTP API against the real daemon on a loopback port."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from cachemgr.daemon import app as app_module
from cachemgr.daemon.app import create_app, openapi_document
from cachemgr.daemon.backend import Backend
from cachemgr.daemon.index_state import IndexState
from cachemgr.daemon.lifecycle import Daemon
from cachemgr.daemon.serving import Reader
from cachemgr.errors import ConfigError
from cachemgr.gc.policy import GcPolicy
from cachemgr.gc.runner import GcRunner
from cachemgr.layout import Layout
from cachemgr.settings import Settings, load_settings
from cachemgr.state.store import Store
from tests.daemon_helpers import (
    NS_A,
    NS_B,
    asgi_get,
    page_name,
    read_page,
    register_namespace,
    running_daemon,
    store_page,
)
from tests.polling import wait_for

REPO = Path(__file__).resolve().parent.parent
PROBLEM = "application/problem+json"


def metric(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def test_an_index_ready_but_not_settled_runs_no_gc(
    layout: Layout, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ready (a sidecar's pod serves), saying what GC waits for; a GC run asked for over HTTP
    would plan from rows that may be stale: it waits for the index to settle (a script that
    waited for /readyz gets its run), and is a 503 if it does not within SETTLE_WAIT."""
    index = IndexState()
    index.live(True, pending="the scan of what changed while down")
    reader = Reader(layout)
    runner = GcRunner(layout, store, GcPolicy())
    backend = Backend(
        layout=layout, reader=reader, registry=CollectorRegistry(), index=index, gc=runner
    )
    app = create_app(backend)

    async def post_gc() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            return await c.post("/v1/gc")

    monkeypatch.setattr(app_module, "SETTLE_WAIT", 0.3)
    try:
        ready = anyio.run(asgi_get, app, "/readyz")
        gc = anyio.run(post_gc)  # never settles
        threading.Timer(0.1, index.settle).start()
        monkeypatch.setattr(app_module, "SETTLE_WAIT", 30.0)
        gc_waited = anyio.run(post_gc)
        verified = anyio.run(asgi_get, app, "/readyz")
    finally:
        reader.close()
        runner.leadership.release()
    detail = ready.json()["detail"]
    assert ready.status_code == 200
    assert detail.endswith("GC starts after the scan of what changed while down")
    assert gc.status_code == 503 and gc.headers["content-type"] == PROBLEM
    assert gc.json()["title"] == "index still settling"
    assert gc.json()["detail"] == "GC starts after the scan of what changed while down"
    assert gc_waited.status_code == 200 and gc_waited.json()["leader"] is True
    assert verified.json() == {"ready": True, "detail": "index live"}


def test_health_status_and_metrics_follow_the_disk(settings: Settings, layout: Layout) -> None:
    d = register_namespace(layout, NS_A, instance="gpu0")
    for i in range(4):
        store_page(d, page_name(i), 4096)
    with running_daemon(settings) as dm:
        assert dm.get("/healthz").json()["status"] == "ok"
        assert dm.get("/readyz").json() == {"ready": True, "detail": "index live"}
        assert dm.status()["index"]["settled"] is True
        for i in range(4, 10):
            store_page(d, page_name(i), 4096)
        for i in range(3):
            read_page(d, page_name(i))
        # The live counters move when an event is read, the page rows when its batch commits.
        ns = wait_for(
            lambda: dm.namespaces()[NS_A],
            lambda n: (n["reads_since_start"], n["pages"]) == (3, 10),
            timeout=5,
        )
        assert (ns["pages"], ns["bytes"], ns["writes_since_start"]) == (10, 40960, 6)
        assert (ns["model"], ns["kv_cache_dtype"], ns["page_size"]) == (
            "Qwen/Qwen3-8B",
            "bfloat16",
            64,
        )
        assert ns["instances"] == ["gpu0"] and ns["hit_ratio"] == pytest.approx(3 / 9)
        one = dm.get(f"/v1/namespaces/{NS_A}").json()
        assert one["pages"] == 10
        # /metrics shows a snapshot the daemon refreshes soon after each batch
        text = wait_for(
            lambda: dm.get("/metrics").text,
            lambda t: (
                metric(t, "cachemgr_namespace_pages", namespace=NS_A) == 10
                and metric(t, "cachemgr_page_reads_total", namespace=NS_A) == 3
            ),
        )
        assert metric(text, "cachemgr_namespace_bytes", namespace=NS_A) == 40960
        assert metric(text, "cachemgr_page_writes_total", namespace=NS_A) == 6
        assert metric(text, "cachemgr_ready") == 1
        info = dict(namespace=NS_A, server_instance="gpu0", model="Qwen/Qwen3-8B", page_size="64")
        assert metric(text, "cachemgr_namespace_info", kv_cache_dtype="bfloat16", **info) == 1
        fp = dm.get("/v1/fingerprint", params={"instance": "gpu0"}).json()
        assert fp[0]["namespace"] == NS_A and fp[0]["identity"]["page_size"] == 64


def test_promtool_accepts_the_metrics(settings: Settings, layout: Layout) -> None:
    d = register_namespace(layout, NS_A)
    store_page(d, page_name(0))
    with running_daemon(settings) as dm:
        text = dm.get("/metrics").text
    check = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_errors_are_problem_json(settings: Settings, layout: Layout) -> None:
    with running_daemon(settings) as dm:
        r = dm.get("/purge")
        assert r.status_code == 405 and r.headers["content-type"] == PROBLEM
        assert "POST" in r.json()["hint"]
        r = dm.get(f"/v1/namespaces/{NS_B}")
        assert r.status_code == 404 and r.json()["title"] == "not found"
        r = dm.get("/v1/namespaces/NOT-AN-ID")
        assert r.status_code == 422 and r.json()["errors"][0]["loc"][0] == "path"
        r = dm.post("/v1/purge", json={"namespace": NS_A, "bogus": 1})  # unknown: a 400
        assert r.status_code == 400 and r.headers["content-type"] == PROBLEM
        r = dm.post("/v1/purge", json={"namespace": NS_B})
        assert r.status_code == 404 and "no namespace" in r.json()["detail"]


def test_mutating_routes_need_the_token(settings: Settings, layout: Layout) -> None:
    register_namespace(layout, NS_A)
    dry = {"dry_run": True, "all": True}
    with running_daemon(load_settings(root=layout.root, token="s3cret")) as dm:
        r = dm.post("/purge", params=dry)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        r = dm.post("/purge", params=dry, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        ok = dm.post("/purge", params=dry, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["dry_run"] is True
        assert dm.get("/v1/status").status_code == 200  # reads stay open


def test_purge_bodies_take_only_json_booleans(settings: Settings, layout: Layout) -> None:
    """The schema says boolean: 0, 0.0 or "yes" must be a 422, never a quiet purge or dry run."""
    register_namespace(layout, NS_A)
    with running_daemon(settings) as dm:
        for route in ("/v1/purge", f"/v1/namespaces/{NS_A}/purge"):
            for value in (0.0, 0, 1, "true"):
                r = dm.post(route, json={"dry_run": value})
                assert r.status_code == 422, (route, value, r.text)
                assert r.headers["content-type"] == "application/problem+json"
            chosen = {} if "namespaces" in route else {"all": True}
            ok = dm.post(route, json={"dry_run": True, **chosen})
            assert ok.status_code == 200 and ok.json()["dry_run"] is True
        assert dm.post("/v1/purge", json={"all": 1, "dry_run": True}).status_code == 422
        assert dm.namespaces()[NS_A]["id"] == NS_A  # nothing was purged


def test_non_ascii_tokens_are_compared_not_a_500(settings: Settings, layout: Layout) -> None:
    register_namespace(layout, NS_A)
    with running_daemon(load_settings(root=layout.root, token="s3cret")) as dm:
        r = dm.post("/purge", headers={"Authorization": "Bearer sécret✓".encode()})
        assert r.status_code == 401
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["status"] == 401
    with running_daemon(load_settings(root=layout.root, token="sécret✓")) as dm:
        good = {"Authorization": "Bearer sécret✓".encode()}
        ok = dm.post("/purge", params={"dry_run": True, "all": True}, headers=good)
        assert ok.status_code == 200 and ok.json()["dry_run"] is True
        bad = dm.post("/purge", params={"dry_run": True}, headers={"Authorization": "Bearer s"})
        assert bad.status_code == 401


@pytest.mark.parametrize("raw", ["s3cret\n", "  s3cret\t", "s3cret\r\n"])
def test_a_token_read_with_surrounding_whitespace_matches(layout: Layout, raw: str) -> None:
    """`kubectl create secret --from-file` keeps the file's newline: the daemon took the token
    with it, HTTP strips a header's whitespace, and every mutating request was 401."""
    settings = load_settings(root=layout.root, token=raw)
    assert settings.token is not None and settings.token.get_secret_value() == "s3cret"
    with running_daemon(settings) as dm:
        good = {"Authorization": "Bearer s3cret"}
        ok = dm.post("/purge", params={"dry_run": True, "all": True}, headers=good)
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("blank", [" ", "\n", " \t "])
def test_a_blank_token_is_no_token(settings: Settings, blank: str) -> None:
    """A token of a space started a daemon on 0.0.0.0 that no request could match; blank is
    refused as the empty one is."""
    blanked = load_settings(root=settings.root, token=blank)
    assert blanked.token is None
    with pytest.raises(ConfigError, match="without a token"):
        Daemon(blanked.model_copy(update={"host": "0.0.0.0"}))


def test_non_loopback_needs_a_token_and_a_busy_port_is_one_line(
    settings: Settings, layout: Layout
) -> None:
    with pytest.raises(ConfigError, match="without a token"):
        Daemon(settings.model_copy(update={"host": "0.0.0.0"}))
    with running_daemon(settings) as dm:
        cli = [sys.executable, "-m", "cachemgr", "--root", str(layout.root), "serve"]
        r = subprocess.run(
            [*cli, "--port", str(dm.daemon.port)], capture_output=True, text=True, check=False
        )
        assert r.returncode == 2
        (line,) = r.stderr.strip().splitlines()  # who holds it: tests/test_serve_port.py
        assert line.startswith(f"cachemgr: error: port {dm.daemon.port} on 127.0.0.1 is in use")


def test_committed_openapi_document_matches_the_app() -> None:
    committed = (REPO / "api" / "openapi.json").read_text()
    assert json.loads(committed) == json.loads(openapi_document()), (
        "api/openapi.json is stale: python -m cachemgr.daemon.app --dump-openapi > api/openapi.json"
    )


def test_status_cli_reads_the_daemon_or_the_disk(settings: Settings, layout: Layout) -> None:
    d = register_namespace(layout, NS_A)
    for i in range(3):
        store_page(d, page_name(i), 100)
    cmd = [sys.executable, "-m", "cachemgr", "--root", str(layout.root), "status", "--json"]
    offline = json.loads(
        subprocess.run([*cmd, "--port", "1"], capture_output=True, check=True).stdout
    )
    assert offline["source"] == "disk" and offline["namespaces"][0]["pages"] == 3
    with running_daemon(settings) as dm:
        port = ["--port", str(dm.daemon.port)]
        live = json.loads(subprocess.run([*cmd, *port], capture_output=True, check=True).stdout)
        assert live["source"] == "daemon" and live["namespaces"][0]["bytes"] == 300
        table = subprocess.run(
            [*cmd[:-1], *port], capture_output=True, text=True, check=True, env={"COLUMNS": "200"}
        ).stdout
        assert NS_A in table and "Qwen/Qwen3-8B" in table


def test_http_client_sees_transport_close_after_shutdown(settings: Settings) -> None:
    with running_daemon(settings) as dm:
        url = dm.url
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/healthz", timeout=2)


def test_uptime_stays_positive_when_the_wall_clock_steps_back(layout: Layout) -> None:
    """Uptime is measured on the monotonic clock; a step back (NTP, an operator's `date -s`)
    made `uptime_seconds` negative when it was the wall clock's now minus the start."""
    with running_daemon(load_settings(root=layout.root, gc_interval=3600)) as dm:
        state = dm.daemon.indexer.state
        # What the wall clock stepping back an hour after the start looks like from here.
        state.started_at += 3600
        status = dm.status()
        assert status["started_at"] == state.started_at
        assert 0 <= status["uptime_seconds"] < 600, status["uptime_seconds"]


def test_a_purge_refused_for_an_unsafe_trash_is_the_roots_state_not_a_bad_request(
    settings: Settings, layout: Layout, tmp_path: Path
) -> None:
    """<root>/.trash replaced by a symlink: the request is fine, the root is not. A 503 (as
    every refusal for the root's or the state dir's state) naming .trash and the symlink, not a
    400 telling the client to change its request; nothing moves, nothing outside is touched."""
    d = register_namespace(layout, NS_A)
    store_page(d, page_name(0))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_bytes(b"not cachemgr's")
    with running_daemon(settings) as dm:
        layout.trash.rmdir()
        layout.trash.symlink_to(elsewhere)
        for route, body in (
            ("/v1/purge", {"namespace": NS_A}),
            (f"/v1/namespaces/{NS_A}/purge", None),
        ):
            r = dm.post(route, json=body)
            assert r.status_code == 503, (route, r.text)
            assert r.headers["content-type"] == PROBLEM
            problem = r.json()
            assert problem["title"] == "unsafe path in the cache root"
            assert ".trash" in problem["detail"] and "symlink" in problem["detail"]
    assert sorted(p.name for p in d.iterdir()) == [page_name(0)]
    assert [p.name for p in elsewhere.iterdir()] == ["keep"]
    purge = json.loads(committed_openapi())["paths"]["/v1/purge"]["post"]["responses"]
    assert "unsafe" in purge["503"]["description"]


def committed_openapi() -> str:
    return (REPO / "api" / "openapi.json").read_text()
