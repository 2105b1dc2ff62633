"""End to end: SGLang's own HiCacheFile against the running daemon, a real Prometheus
scraping it, and `curl -X POST /purge`."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachemgr.layout import Layout
from cachemgr.settings import Settings
from tests.conftest import SglangDriver
from tests.daemon_helpers import (
    IDENTITY,
    NS_A,
    NS_B,
    page_name,
    read_page,
    register_namespace,
    running_daemon,
    store_page,
)
from tests.polling import wait_for
from tests.test_server import metric


def on_disk(d: Path) -> tuple[int, int]:
    files = [p for p in d.iterdir() if p.name.endswith(".bin")]
    return len(files), sum(p.stat().st_size for p in files)


@pytest.mark.sglang
def test_daemon_counts_what_sglang_did_and_purge_empties_it(
    sglang: SglangDriver, settings: Settings, layout: Layout
) -> None:
    small = {**IDENTITY, "source": {**IDENTITY["source"], "served_model_name": "Qwen/Qwen3-0.6B"}}
    dirs = {
        NS_A: register_namespace(layout, NS_A, instance="gpu0"),
        NS_B: register_namespace(layout, NS_B, instance="gpu1", identity=small),
    }
    with running_daemon(settings) as dm:
        handles = {
            NS_A: sglang.open(dirs[NS_A], model="Qwen/Qwen3-8B"),
            NS_B: sglang.open(dirs[NS_B], model="Qwen/Qwen3-0.6B", tp_rank=1, tp_size=2),
        }
        system = [1, 640]  # a shared system prompt: 10 pages every session starts with
        sessions = {
            NS_A: [[system, [100 + s, 64 * (s + 2)]] for s in range(4)],
            NS_B: [[system, [200 + s, 192]] for s in range(3)],
        }
        stored = dict.fromkeys(dirs, 0)
        read = dict.fromkeys(dirs, 0)
        for ns, segs in sessions.items():
            for tokens in segs:
                w = sglang.write(handles[ns], tokens)
                assert w["failed"] == 0
                stored[ns] += w["stored"]
            for tokens in segs[:2] + segs:  # the first two sessions come back twice
                r = sglang.read(handles[ns], tokens)
                assert r["correct"] == r["read"] == r["hit_pages"] and not r["errors"]
                read[ns] += r["read"]
        expected = {
            ns: {
                "pages": on_disk(d)[0],
                "bytes": on_disk(d)[1],
                "reads_since_start": read[ns],
                "writes_since_start": stored[ns],
            }
            for ns, d in dirs.items()
        }
        assert stored[NS_A] == 10 + sum(s + 2 for s in range(4))  # the system prompt once

        def seen() -> dict[str, dict[str, Any]]:
            got = dm.namespaces()
            return {ns: {k: got[ns][k] for k in expected[ns]} for ns in dirs}

        # Every SGLang call has returned: the daemon must agree within about one batch.
        wait_for(seen, lambda s: s == expected, timeout=4 * settings.batch_interval + 1)

        r = dm.post("/purge", params={"all": True})  # curl -X POST host:port/purge?all=true
        assert r.status_code == 200, r.text
        body = r.json()
        assert sorted(p["namespace"] for p in body["purged"]) == [NS_A, NS_B]
        assert body["pages"] == sum(e["pages"] for e in expected.values())
        assert "purged 2 namespace(s)" in body["message"]
        wait_for(seen, lambda s: all(v["pages"] == v["bytes"] == 0 for v in s.values()))
        text = wait_for(  # /metrics shows a snapshot the daemon refreshes soon after a purge
            lambda: dm.get("/metrics").text,
            lambda t: (
                metric(t, "cachemgr_purges_total", reason="manual") == 2
                and metric(t, "cachemgr_namespace_pages", namespace=NS_A) == 0
            ),
        )
        assert metric(text, "cachemgr_purged_pages_total", reason="manual") == body["pages"]
        assert all(on_disk(d) == (0, 0) for d in dirs.values())  # recreated empty: bound
        # SGLang keeps writing to its (recreated) dir; the index follows.
        w = sglang.write(handles[NS_A], sessions[NS_A][0])
        wait_for(lambda: seen()[NS_A]["pages"], lambda n: n == w["stored"] == 12)


@pytest.fixture
def prometheus(tmp_path: Path, free_port: int) -> Iterator[tuple[Path, str]]:
    """A config dir and the base URL of a Prometheus server started on demand."""
    yield tmp_path / "prom", f"http://127.0.0.1:{free_port}"


def start_prometheus(
    config_dir: Path, url: str, target: str, rules: Sequence[Path] = ()
) -> subprocess.Popen[bytes]:
    """Prometheus scraping `target` as job cachemgr every second, evaluating `rules`."""
    config_dir.mkdir()
    (config_dir / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files: {json.dumps([str(r) for r in rules])}\n"
        "scrape_configs:\n  - job_name: cachemgr\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    return subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config_dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={config_dir / 'data'}",
            f"--web.listen-address={url.removeprefix('http://')}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def promql(url: str, query: str) -> list[dict[str, Any]]:
    try:
        r = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=5)
    except httpx.TransportError:
        return []
    if r.status_code == 503:  # "Service Unavailable" as plain text while Prometheus starts
        return []
    data = r.json()
    return data["data"]["result"] if data.get("status") == "success" else []


def test_prometheus_scrapes_page_count_and_hit_ratio(
    settings: Settings, layout: Layout, prometheus: tuple[Path, str]
) -> None:
    d = register_namespace(layout, NS_A, instance="gpu0")
    with running_daemon(settings) as dm:
        for i in range(8):
            store_page(d, page_name(i))
        for i in range(6):
            read_page(d, page_name(i % 4))
        wait_for(lambda: dm.namespaces()[NS_A]["reads_since_start"], lambda n: n == 6)
        config_dir, url = prometheus
        proc = start_prometheus(config_dir, url, dm.url.removeprefix("http://"))
        try:
            pages = wait_for(
                lambda: promql(url, f'cachemgr_namespace_pages{{namespace="{NS_A}"}}'),
                lambda res: bool(res),
                timeout=60,
                every=0.5,
            )
            assert float(pages[0]["value"][1]) == 8
            ratio = promql(
                url,
                "sum by (namespace) (cachemgr_page_reads_total) / (sum by (namespace)"
                " (cachemgr_page_reads_total) + sum by (namespace) (cachemgr_page_writes_total))",
            )
            assert ratio[0]["metric"] == {"namespace": NS_A}
            assert float(ratio[0]["value"][1]) == pytest.approx(6 / 14)
            up = promql(url, 'up{job="cachemgr"}')
            assert float(up[0]["value"][1]) == 1
        finally:
            proc.terminate()
            proc.wait(30)
