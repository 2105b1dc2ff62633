"""The SGLang probe against a small SGLang stand-in on loopback serving canned /metrics and
/server_info documents in SGLang's own formats (a real server needs a GPU)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from cachemgr.sglang.probe import ambiguities, contradictions, parse_metrics
from tests.daemon_helpers import (
    IDENTITY,
    NS_A,
    page_name,
    register_namespace,
    running_daemon,
    store_page,
)
from tests.polling import wait_for
from tests.test_server import metric

# As sglang/srt/observability/metrics_collector.py (0.5.23) exposes them, two TP ranks.
METRICS = """\
# HELP sglang:prefetched_tokens_total Prompt tokens successfully transferred from L3 storage.
# TYPE sglang:prefetched_tokens_total counter
sglang:prefetched_tokens_total{model_name="Qwen/Qwen3-8B",tp_rank="0",pp_rank="0"} 512.0
sglang:prefetched_tokens_total{model_name="Qwen/Qwen3-8B",tp_rank="1",pp_rank="0"} 512.0
# HELP sglang:backuped_tokens_total Number of backuped tokens.
# TYPE sglang:backuped_tokens_total counter
sglang:backuped_tokens_total{model_name="Qwen/Qwen3-8B",tp_rank="0",pp_rank="0"} 4096.0
# HELP sglang:storage_prefetch_hit_tokens_total Storage-hit tokens returned by an L3 query.
# TYPE sglang:storage_prefetch_hit_tokens_total counter
sglang:storage_prefetch_hit_tokens_total{model_name="Qwen/Qwen3-8B",tp_rank="0",pp_rank="0"} 640.0
sglang:storage_prefetch_hit_tokens_total{model_name="Qwen/Qwen3-8B",tp_rank="1",pp_rank="0"} 640.0
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="Qwen/Qwen3-8B",tp_rank="0",pp_rank="0"} 1.0
"""
# A trimmed /server_info (server_args.resolved_dict() plus scheduler info and version).
SERVER_INFO: dict[str, Any] = {
    "model_path": "/models/Qwen3-8B",
    "served_model_name": "Qwen/Qwen3-8B",
    "kv_cache_dtype": "auto",
    "page_size": 64,
    "tp_size": 2,
    "enable_hierarchical_cache": True,
    "hicache_storage_backend": "file",
    "hicache_mem_layout": "page_first",
    "version": "0.5.23",
    "internal_states": [{"last_gen_throughput": 0.0}],
}


class FakeSglang(BaseHTTPRequestHandler):
    info: ClassVar[dict[str, Any]] = {}

    def do_GET(self) -> None:
        if self.path == "/metrics":
            body, ctype = METRICS.encode(), "text/plain; version=0.0.4"
        elif self.path == "/server_info":
            body, ctype = json.dumps(self.info).encode(), "application/json"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def fake_sglang() -> Iterator[tuple[str, dict[str, Any]]]:
    """The stand-in's URL and its /server_info document (mutable)."""
    FakeSglang.info = dict(SERVER_INFO)
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeSglang)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", FakeSglang.info
    server.shutdown()
    server.server_close()
    thread.join()


def test_token_counters_are_summed_over_ranks() -> None:
    t = parse_metrics(METRICS)
    assert (t.storage_hit_tokens, t.prefetched_tokens, t.backuped_tokens) == (1280, 1024, 4096)


def with_page_from(origin: str | None, page_size: int | None = 1) -> dict[str, Any]:
    """IDENTITY whose page size came from `origin` (None: an older record without it)."""
    source = {**IDENTITY["source"], **({"page_size_from": origin} if origin else {})}
    return {**IDENTITY, "page_size": page_size, "source": source}


def test_contradictions_name_each_differing_argument() -> None:
    explicit = with_page_from("flag", 64)
    assert contradictions(SERVER_INFO, explicit) == []
    bad = {**SERVER_INFO, "kv_cache_dtype": "fp8_e4m3", "page_size": 1, "model_path": "/m/x"}
    assert [d.split(":")[0] for d in contradictions(bad, explicit)] == [
        "kv_cache_dtype",
        "page_size",
        "model_path",
    ]
    assert ambiguities(bad, explicit) == []


@pytest.mark.parametrize("origin", ["server", None])
def test_a_page_size_the_server_resolved_is_ambiguous_not_a_contradiction(
    origin: str | None,
) -> None:
    # SGLang forced 64 (trtllm_mha on SM100) where the record has no explicit page size.
    ident = with_page_from(origin, 1)
    assert contradictions(SERVER_INFO, ident) == []
    assert ambiguities(SERVER_INFO, ident) == ["page_size: namespace 1 ≠ server 64"]
    assert contradictions(SERVER_INFO, with_page_from("server", None)) == []
    assert ambiguities(SERVER_INFO, with_page_from("server", None)) == []
    forced = with_page_from("attention_backend", 1)
    assert contradictions(SERVER_INFO, forced) == ["page_size: namespace 1 ≠ server 64"]


def test_an_ambiguous_page_size_raises_the_alarm_and_never_purges(
    layout: Layout, fake_sglang: tuple[str, dict[str, Any]]
) -> None:
    url, _ = fake_sglang
    d = register_namespace(layout, NS_A, instance="gpu0", identity=with_page_from("server", 1))
    for i in range(5):
        store_page(d, page_name(i))
    settings = load_settings(
        root=layout.root, sglang_url=url, sglang_poll_interval=0.05, instance="gpu0"
    )
    with running_daemon(settings) as dm:
        text = wait_for(
            lambda: dm.get("/metrics").text,
            lambda t: metric(t, "cachemgr_identity_mismatch") == 1,
        )
        assert metric(text, "cachemgr_purges_total", reason="mismatch") in (None, 0)
        assert metric(text, "cachemgr_identity_mismatches_total") == 0
        wait_for(lambda: dm.namespaces()[NS_A]["pages"], lambda n: n == 5)
    assert len(list(d.iterdir())) == 5


def test_a_server_launched_without_init_gets_its_namespace_purged(
    layout: Layout, fake_sglang: tuple[str, dict[str, Any]]
) -> None:
    url, info = fake_sglang
    d = register_namespace(layout, NS_A, instance="gpu0")
    for i in range(5):
        store_page(d, page_name(i))
    settings = load_settings(
        root=layout.root, sglang_url=url, sglang_poll_interval=0.1, instance="gpu0"
    )
    with running_daemon(settings) as dm:
        text = wait_for(
            lambda: dm.get("/metrics").text,
            lambda t: metric(t, "cachemgr_sglang_up") == 1,
        )
        assert metric(text, "cachemgr_sglang_storage_hit_tokens_total") == 1280
        assert metric(text, "cachemgr_identity_mismatch") == 0
        assert dm.namespaces()[NS_A]["pages"] == 5  # agreeing server: nothing purged
        info["kv_cache_dtype"] = "fp8_e4m3"  # restarted with another KV dtype, no init
        text = wait_for(
            lambda: dm.get("/metrics").text,
            lambda t: metric(t, "cachemgr_purges_total", reason="mismatch") == 1,
        )
        assert metric(text, "cachemgr_identity_mismatch") == 1
        assert metric(text, "cachemgr_identity_mismatches_total") == 1
        wait_for(lambda: dm.namespaces()[NS_A]["pages"], lambda n: n == 0)
        assert d.is_dir() and not any(d.iterdir())  # bound: recreated empty for the server


@pytest.mark.parametrize("bad", ["x", 1e400, {"a": 1}], ids=["string", "huge", "object"])
def test_a_malformed_server_info_is_down_not_a_dead_probe(
    layout: Layout, fake_sglang: tuple[str, dict[str, Any]], bad: object
) -> None:
    """A value of the wrong type in /server_info reads as "sglang down"; the probe keeps
    polling (a dead worker would keep the sidecar not-ready until a restart)."""
    url, info = fake_sglang
    info["page_size"] = bad
    info["kv_cache_dtype"] = bad
    d = register_namespace(layout, NS_A, instance="gpu0", identity=with_page_from("flag", 64))
    store_page(d, page_name(0))
    settings = load_settings(
        root=layout.root, sglang_url=url, sglang_poll_interval=0.05, instance="gpu0"
    )
    with running_daemon(settings) as dm:
        assert dm.daemon.probe is not None
        probe = dm.daemon.probe
        wait_for(lambda: probe.last_error or "", lambda e: "cannot read" in e)
        # the error is set a moment before the up gauge: read it once both are written
        wait_for(lambda: metric(dm.get("/metrics").text, "cachemgr_sglang_up"), lambda v: v == 0)
        info.update(SERVER_INFO)  # the server answers sanely again: up, and nothing purged
        text = wait_for(
            lambda: dm.get("/metrics").text, lambda t: metric(t, "cachemgr_sglang_up") == 1
        )
        assert metric(text, "cachemgr_worker_up", worker="probe") == 1
        assert dm.get("/readyz").status_code == 200
    assert len(list(d.iterdir())) == 1
