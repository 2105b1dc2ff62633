"""deploy/prometheus and deploy/grafana against a real daemon's /metrics, checked by promtool."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from cachemgr.daemon.fleet import FLEET_METRICS
from tests.deploy_model import make_model
from tests.deploy_promql import (
    Exposition,
    Sample,
    dashboard_exprs,
    promql_refs,
    render,
    rule_exprs,
)
from tests.polling import wait_for
from tests.test_daemon_e2e import start_prometheus
from tests.vllm_launch import launch, vinit_json
from tests.vllmtrees import block_path, key, vllm_load, vllm_store, write_folder

REPO = Path(__file__).resolve().parent.parent
PROM = REPO / "deploy" / "prometheus"
RULE_FILES = sorted((PROM / "rules").glob("*.yml"))
DASHBOARD = REPO / "deploy" / "grafana" / "cachemgr.json"
TOKEN = "deploy-test-token"
TARGET = {"job": "cachemgr", "instance": "cachemgr:9477"}
# SGLang's own series that rules and dashboard may use (checked against SGLang's source in
# test_sglang_metric_names_exist_in_sglang), with the labels its collectors give them.
SGLANG_SERIES = {
    "sglang:prompt_tokens_total": {"model_name", "engine_type", "is_streaming"},
    "sglang:cached_tokens_total": {"model_name", "engine_type", "cache_source"},
    "sglang:storage_prefetch_hit_tokens_total": {"model_name"},
    "sglang:prefetched_tokens_total": {"model_name"},
    "sglang:backuped_tokens_total": {"model_name"},
}
TARGET_LABELS = {"job", "instance"}


def write_page(ns_dir: Path, n: int) -> None:
    """A page as SGLang's file backend stores it: a temp file renamed onto the page name."""
    tmp = ns_dir / f".{uuid.uuid4().hex}.tmp"
    tmp.write_bytes(n.to_bytes(8, "little") * 512)
    os.replace(tmp, ns_dir / f"{n:064x}_qwen3-8b_0_1.bin")


def read_page(ns_dir: Path, n: int) -> None:
    with open(ns_dir / f"{n:064x}_qwen3-8b_0_1.bin", "rb") as f:
        f.read()


@dataclass(frozen=True)
class Live:
    """Two scrapes of one real daemon, the SGLang and vLLM namespaces the traffic went to, and
    the URL of a real Prometheus scraping the daemon with deploy/'s rules."""

    first: Exposition
    second: Exposition
    ns: str
    vllm_ns: str
    prometheus: str


def init(root: Path, model: Path, instance: str, kv_dtype: str) -> str:
    """`cachemgr init` as a deployment runs it; the namespace id it created."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cachemgr",
            "--root",
            str(root),
            "init",
            "--instance",
            instance,
            "--print-env",
            "--sglang-version",
            "0.5.19",
            "--",
            "sglang",
            "serve",
            "--model-path",
            str(model),
            "--kv-cache-dtype",
            kv_dtype,
            "--page-size",
            "64",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return out.stdout.strip().rsplit("/", 1)[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prom_query(url: str, query: str) -> list[dict[str, Any]]:
    """The result of an instant query; an error Prometheus answers fails the test."""
    r = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "success", f"{query}: {r.text}"
    result: list[dict[str, Any]] = r.json()["data"]["result"]
    return result


def prom_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """A real `cachemgr serve`, scraped by the test and by a real Prometheus, before and after
    6 page writes, 2 reads and a purge in an SGLang namespace and 3 block stores and 2 loads in
    a vLLM namespace."""
    base = tmp_path_factory.mktemp("deploy-metrics")
    root = base / "root"
    make_model(base / "model")
    ns_a = init(root, base / "model", "sglang", "fp8_e4m3")
    ns_b = init(root, base / "model", "old", "bfloat16")
    vllm = vinit_json(root, launch(base / "model"), "--instance", "vllm", "--vllm-version", "0.33")
    ns_v, v_dir = vllm["ns_id"], root / "ns" / vllm["ns_id"]
    folder = write_folder(v_dir)
    blocks = [block_path(folder, key(i)) for i in range(6)]
    for ns, pages in ((ns_a, 4), (ns_b, 2)):
        for n in range(pages):
            write_page(root / "ns" / ns, n)
    for rel in blocks[:3]:
        vllm_store(v_dir, rel)
    port, prom_dir, prom_url = free_port(), base / "prometheus", f"http://127.0.0.1:{free_port()}"
    log = (base / "daemon.log").open("w")
    argv = [sys.executable, "-m", "cachemgr", "--root", str(root), "--log-format", "json"]
    proc = subprocess.Popen(
        [*argv, "serve", "--port", str(port), "--token", TOKEN], stdout=log, stderr=log
    )
    prom: subprocess.Popen[bytes] | None = None
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:

            def scrape() -> Exposition:
                return Exposition.parse(http.get("/metrics").text)

            def ready() -> bool:
                try:
                    return http.get("/readyz").status_code == 200
                except httpx.TransportError:
                    return proc.poll() is not None  # exited: fail below, not by timeout

            wait_for(ready, timeout=20, what="the daemon's /readyz")
            assert proc.poll() is None, (base / "daemon.log").read_text()
            wait_for(
                lambda: (
                    [
                        scrape().get("cachemgr_namespace_pages", namespace=ns).value
                        for ns in (ns_a, ns_v)
                    ]
                    == [4, 3]
                ),
                timeout=20,
                what="the scan",
            )
            first = scrape()
            # Prometheus's first samples come before the traffic: its rates see all of it.
            prom = start_prometheus(prom_dir, prom_url, f"127.0.0.1:{port}", RULE_FILES)
            wait_for(lambda: prom_ready(prom_url), timeout=60, every=0.5, what="Prometheus")
            wait_for(
                lambda: prom_query(prom_url, 'cachemgr_page_writes_total{engine="vllm"}'),
                timeout=60,
                every=0.5,
                what="Prometheus's first scrape",
            )
            for n in range(4, 10):
                write_page(root / "ns" / ns_a, n)
            for n in (0, 1):
                read_page(root / "ns" / ns_a, n)
            for rel in blocks[3:]:
                vllm_store(v_dir, rel)
            for rel in blocks[:2]:
                vllm_load(v_dir, rel)
            headers = {"Authorization": f"Bearer {TOKEN}"}
            purged = http.post("/purge", json={"namespace": ns_b}, headers=headers)
            assert purged.status_code == 200, purged.text

            def counted() -> bool:
                e = scrape()
                counts = [
                    e.get(name, namespace=ns).value
                    for ns in (ns_a, ns_v)
                    for name in ("cachemgr_page_reads_total", "cachemgr_page_writes_total")
                ]
                return counts == [2, 6, 2, 3] and bool(e.all("cachemgr_purges_total"))

            wait_for(counted, timeout=20, what="the reads, writes and a purge in /metrics")
            yield Live(first, scrape(), ns_a, ns_v, prom_url)
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(timeout=30)
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def load_rules() -> list[dict[str, Any]]:
    return [g for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"]]


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_promtool_check_rules() -> None:
    out = promtool("check", "rules", *map(str, RULE_FILES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(RULE_FILES) >= 2


def test_promtool_check_config_with_the_rules(tmp_path: Path) -> None:
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/rules/*.yml"]  # where compose mounts them
    config["rule_files"] = [str(PROM / "rules" / "*.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    out = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert {j["job_name"] for j in config["scrape_configs"]} == {"cachemgr", "sglang"}


def queries() -> list[tuple[str, str]]:
    """Every PromQL expression deploy/ ships: rules, dashboard panels, variables, annotations."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [*rule_exprs(load_rules()), *dashboard_exprs(dashboard)]


def test_rules_and_dashboard_query_only_metrics_the_daemon_serves(
    scrapes: Live,
) -> None:
    first, second = scrapes.first, scrapes.second
    recorded = {r["record"] for g in load_rules() for r in g["rules"] if "record" in r}
    # The fleet row's series exist only in fleet mode: test_fleet_deploy checks them live.
    fleet = set(FLEET_METRICS)
    known = first.names | second.names | set(SGLANG_SERIES) | recorded | {"up"} | fleet
    labels = first.labels | second.labels | TARGET_LABELS | set().union(*SGLANG_SERIES.values())
    labels |= {"node"}
    used: set[str] = set()
    for where, expr in queries():
        refs = promql_refs(expr)
        assert refs.metrics, f"{where}: no metric found in {expr!r}"
        assert refs.metrics <= known, f"{where}: {sorted(refs.metrics - known)} not served"
        assert refs.labels <= labels, f"{where}: labels {sorted(refs.labels - labels)} unknown"
        used |= refs.metrics
    for name in (
        "cachemgr_page_reads_total",
        "cachemgr_namespace_info",
        "sglang:prompt_tokens_total",
    ):
        assert name in used


def fill_in(expr: str, **values: str) -> str:
    """A dashboard query as Grafana sends it: variables filled in (all values, else `values`), a
    variable's label_values(SELECTOR, label) as its SELECTOR."""
    if expr.startswith("label_values("):
        expr = expr.removeprefix("label_values(").rsplit(",", 1)[0]
    grafana = {"__rate_interval": "5m", "instance": ".*", "engine": ".*", "namespace": ".*"}
    for var, value in {**grafana, **values}.items():
        expr = expr.replace(f"${var}", value)
    return expr


def test_dashboard_panels_cover_the_issue_and_are_valid_promql(tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in [
        "pages per namespace",
        "bytes per namespace",
        "page hit ratio",
        "sglang token-level",
        "evicted by reason",
        "purges by reason",
        "free space",
        "identity timeline",
        "watcher overflows",
        "pages by engine",
        "bytes by engine",
        "page hit ratio by engine",
    ]:
        assert topic in titles, topic
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    # promtool parses each query as a recording rule, Grafana's variables filled in.
    rules = [
        {"record": f"dashboard_query_{i}", "expr": fill_in(expr)}
        for i, (_, expr) in enumerate(dashboard_exprs(dashboard))
    ]
    (tmp_path / "dashboard.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "d", "rules": rules}]})
    )
    out = promtool("check", "rules", str(tmp_path / "dashboard.yml"))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.sglang
def test_sglang_metric_names_exist_in_sglang() -> None:
    """The SGLang series the rules and dashboard use are in SGLang's own metrics collector."""
    from tests.conftest import SGLANG_ENV

    found = list(
        SGLANG_ENV.glob("lib/python3*/site-packages/sglang/srt/observability/metrics_collector.py")
    )
    if not found:
        pytest.fail(f"{SGLANG_ENV} has no SGLang: run scripts/sglang-env.sh (make test does)")
    source = found[0].read_text()
    for name in SGLANG_SERIES:
        assert f'name="{name.removesuffix("_total")}' in source, name
    for label in ("cache_source", "is_streaming", "model_name"):
        assert f'"{label}"' in source


def target(sample: Sample, **labels: str) -> str:
    """The series Prometheus stores for `sample` scraped from job cachemgr (honor_labels off)."""
    # Prometheus renames a scraped label that clashes with a target label and drops empty ones.
    own = {f"exported_{k}" if k in TARGET else k: v for k, v in sample.labels if v}
    return Sample(sample.name, tuple({**own, **labels}.items()), 0).series(**TARGET)


def sel(name: str, **labels: str) -> str:
    """A series selector: `name{k="v", ...}`."""
    return Sample(name, (), 0).series(**labels)


def alert_annotations(name: str, labels: dict[str, str], value: float) -> dict[str, str]:
    (rule,) = [r for g in load_rules() for r in g["rules"] if r.get("alert") == name]
    return {k: render(v, labels, value) for k, v in rule["annotations"].items()}


def expect(name: str, labels: dict[str, str], value: float = 0.0) -> dict[str, Any]:
    (rule,) = [r for g in load_rules() for r in g["rules"] if r.get("alert") == name]
    full = {**labels, **rule["labels"]}
    return {
        "exp_labels": full,
        "exp_annotations": alert_annotations(name, {**full, "alertname": name}, value),
    }


def run_promtool_tests(tmp_path: Path, tests: list[dict[str, Any]], every: str = "1m") -> None:
    """`promtool test rules` of `tests` against the shipped rules, evaluated `every` interval."""
    spec = {
        "rule_files": [str(f) for f in RULE_FILES],
        "evaluation_interval": every,
        "tests": tests,
    }
    (tmp_path / f"tests-{every}.yml").write_text(yaml.safe_dump(spec, sort_keys=False))
    out = promtool("test", "rules", str(tmp_path / f"tests-{every}.yml"))
    assert out.returncode == 0, out.stdout + out.stderr


def test_recording_rules_on_real_scrapes(scrapes: Live, tmp_path: Path) -> None:
    """The two real scrapes, 5 minutes apart: the hit ratio is 2 reads / (2 reads + 6 writes)
    in the SGLang namespace, 2 loads / (2 loads + 3 stores) in the vLLM one."""
    first, second, ns_id, ns_v = scrapes.first, scrapes.second, scrapes.ns, scrapes.vllm_ns
    series = []
    for s in second.samples:
        before = [b for b in first.samples if b.name == s.name and b.labels == s.labels]
        v1 = before[0].value if before else s.value
        series.append(
            {"series": target(s), "values": " ".join([repr(v1)] * 5 + [repr(s.value)] * 6)}
        )
    # SGLang's series as its collectors label them: 250 of every 1000 prompt tokens from L3.
    sglang = {"job": "sglang", "instance": "sglang:30000", "model_name": "qwen3.8-27b"}
    tokens = {"engine_type": "unified", **sglang}
    series += [
        {
            "series": sel("sglang:prompt_tokens_total", is_streaming="false", **tokens),
            "values": "0+1000x10",
        },
        {
            "series": sel("sglang:cached_tokens_total", cache_source="storage", **tokens),
            "values": "0+250x10",
        },
        {
            "series": sel("sglang:cached_tokens_total", cache_source="device", **tokens),
            "values": "0+500x10",
        },
    ]
    ratio = (
        second.get("cachemgr_filesystem_avail_bytes").value
        / second.get("cachemgr_filesystem_size_bytes").value
    )
    hit_ratio = "namespace:cachemgr_page_hit_ratio:rate5m"
    checks = [
        (
            sel(hit_ratio, namespace=ns_id),
            "6m",
            sel(hit_ratio, namespace=ns_id, engine="sglang", **TARGET),
            0.25,
        ),
        (
            sel(hit_ratio, namespace=ns_v),
            "6m",
            sel(hit_ratio, namespace=ns_v, engine="vllm", **TARGET),
            0.4,
        ),
        (
            "model_name:sglang_storage_hit_ratio:rate5m",
            "8m",
            sel("model_name:sglang_storage_hit_ratio:rate5m", **sglang),
            0.25,
        ),
        (
            "instance:cachemgr_filesystem_avail:ratio",
            "8m",
            sel("instance:cachemgr_filesystem_avail:ratio", **TARGET),
            ratio,
        ),
    ]
    tests = [
        {"expr": expr, "eval_time": at, "exp_samples": [{"labels": labels, "value": value}]}
        for expr, at, labels, value in checks
    ]
    run_promtool_tests(
        tmp_path, [{"interval": "1m", "input_series": series, "promql_expr_test": tests}]
    )


def alert_test(
    name: str, series: dict[str, str], at: str, fires: list[dict[str, Any]], interval: str = "1m"
) -> dict[str, Any]:
    return {
        "interval": interval,
        "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": fires}],
    }


def test_alerts_fire_on_the_daemons_real_series(scrapes: Live, tmp_path: Path) -> None:
    """Each alert, firing and quiet, on series named and labelled as the daemon exports them:
    the namespace alerts for an SGLang and a vLLM namespace, all quiet on both at rest."""
    e, ns_id, ns_v = scrapes.second, scrapes.ns, scrapes.vllm_ns
    up = Sample("up", (), 0).series(**TARGET)
    ready, mismatch = target(e.get("cachemgr_ready")), target(e.get("cachemgr_identity_mismatch"))
    settled = target(e.get("cachemgr_index_settled"))
    state_dir = target(e.get("cachemgr_state_dir_unusable"))
    keys = target(e.get("cachemgr_gc_model_keys_in_memory"))
    overflows = target(e.get("cachemgr_watcher_overflows_total"))
    short = target(e.get("cachemgr_watch_refused_namespaces"))
    root_short = target(e.get("cachemgr_watch_root_refused"))
    avail = target(e.get("cachemgr_filesystem_avail_bytes"))
    size_sample = e.get("cachemgr_filesystem_size_bytes")
    size, full = target(size_sample), repr(size_sample.value)
    low = repr(size_sample.value / 32)  # 3.125% free: below the 5% floor
    pages = target(e.get("cachemgr_namespace_pages", namespace=ns_id))
    reads = target(e.get("cachemgr_page_reads_total", namespace=ns_id))
    writes = target(e.get("cachemgr_page_writes_total", namespace=ns_id))
    purges = target(e.all("cachemgr_purges_total")[0])
    leader = target(e.get("cachemgr_gc_leader"))
    gc_up_sample = e.get("cachemgr_worker_up", worker="gc")
    gc_up, worker = target(gc_up_sample), {**TARGET, **dict(gc_up_sample.labels)}
    gc_ok = target(e.get("cachemgr_gc_last_success_timestamp_seconds"))
    refused_sample = e.get("cachemgr_gc_refused_files_total", reason="permission")
    refused, refused_labels = target(refused_sample), {**TARGET, **dict(refused_sample.labels)}
    unmet_sample = e.get("cachemgr_gc_limits_unmet", limit="free_space")
    unmet, unmet_labels = target(unmet_sample), {**TARGET, **dict(unmet_sample.labels)}
    info_sample = e.get("cachemgr_namespace_info", namespace=ns_id)
    info = target(info_sample, page_size="1")
    v_pages = target(e.get("cachemgr_namespace_pages", namespace=ns_v))
    v_reads = target(e.get("cachemgr_page_reads_total", namespace=ns_v))
    v_writes = target(e.get("cachemgr_page_writes_total", namespace=ns_v))
    v_info = target(e.get("cachemgr_namespace_info", namespace=ns_v), page_size="1")
    dir_ratio = target(e.get("cachemgr_namespace_dir_entries_limit_ratio", namespace=ns_id))
    node = dict(TARGET)
    ns = {**TARGET, "namespace": ns_id}
    vns = {**TARGET, "namespace": ns_v, "engine": "vllm"}
    # Both engines' namespaces at rest (the filesystem as roomy as it is big): nothing fires.
    at_rest = {target(s): f"{s.value!r}x30" for s in e.samples}
    at_rest[avail] = at_rest[size]
    assert {dict(s.labels).get("engine") for s in e.samples} >= {"sglang", "vllm"}
    # No label of cachemgr's may collide with a target label (it would become exported_*).
    assert not {k for s in e.samples for k, _ in s.labels} & set(TARGET)
    info_labels = dict(info_sample.labels)
    info_labels |= {"page_size": "1", **TARGET}
    assert info_labels["model"] and info_labels["kv_cache_dtype"] == "fp8_e4m3"
    tests = [
        alert_test("CachemgrDown", {up: "1 1 0x10"}, "8m", [expect("CachemgrDown", node)]),
        alert_test("CachemgrDown", {up: "1x10"}, "8m", []),
        alert_test("CachemgrNotReady", {ready: "0x20"}, "16m", [expect("CachemgrNotReady", node)]),
        alert_test("CachemgrNotReady", {ready: "0 0 1x20"}, "16m", []),
        alert_test(
            "CachemgrGcNotStarted",
            {ready: "1x40", settled: "0x40"},
            "31m",
            [expect("CachemgrGcNotStarted", node)],
        ),
        alert_test("CachemgrGcNotStarted", {ready: "1x40", settled: "0 0 1x40"}, "31m", []),
        # Not ready at all: CachemgrNotReady says so, not this one.
        alert_test("CachemgrGcNotStarted", {ready: "0x40", settled: "0x40"}, "31m", []),
        alert_test(
            "CachemgrWorkerDead", {gc_up: "1 0x5"}, "4m", [expect("CachemgrWorkerDead", worker)]
        ),
        alert_test("CachemgrWorkerDead", {gc_up: "1x5"}, "4m", []),
        alert_test(
            "CachemgrStateDirUnusable",
            {state_dir: "0 1x10"},
            "7m",
            [expect("CachemgrStateDirUnusable", node, 1)],
        ),
        # A full disk GC frees within seconds (the state dir on the root's): quiet.
        alert_test("CachemgrStateDirUnusable", {state_dir: "0 1 0 1 0x10"}, "7m", []),
        # Keys held in memory for 15 minutes fire; a full disk freed within minutes does not.
        alert_test(
            "CachemgrModelKeysInMemory",
            {keys: "0 4096x20"},
            "17m",
            [expect("CachemgrModelKeysInMemory", node, 4096)],
        ),
        alert_test("CachemgrModelKeysInMemory", {keys: "0 4096x5 0x15"}, "17m", []),
        alert_test(
            "CachemgrIdentityMismatch",
            {mismatch: "0 0 1 1"},
            "3m",
            [expect("CachemgrIdentityMismatch", node, 1)],
        ),
        alert_test("CachemgrIdentityMismatch", {mismatch: "0x5"}, "3m", []),
        alert_test(
            "CachemgrDiskFreeLow",
            {avail: f"{low}x15", size: f"{full}x15"},
            "12m",
            [expect("CachemgrDiskFreeLow", node, 1 / 32)],
        ),
        alert_test("CachemgrDiskFreeLow", {avail: f"{full}x15", size: f"{full}x15"}, "12m", []),
        # A flat dir at 85% of its entry limit for 15 minutes; at 75% it is quiet.
        alert_test(
            "CachemgrDirIndexNearlyFull",
            {dir_ratio: "0.85x15"},
            "12m",
            [expect("CachemgrDirIndexNearlyFull", {**ns, "engine": "sglang"}, 0.85)],
        ),
        alert_test("CachemgrDirIndexNearlyFull", {dir_ratio: "0.75x15"}, "12m", []),
        # The leader's last success at t=0, nothing since: at 45m it is 2700 s old.
        alert_test(
            "CachemgrGCFailing",
            {leader: "1x70", gc_ok: "0x70"},
            "45m",
            [expect("CachemgrGCFailing", node, 2700)],
        ),
        alert_test("CachemgrGCFailing", {leader: "1x70", gc_ok: "0+60x70"}, "45m", []),
        alert_test("CachemgrGCFailing", {leader: "0x70", gc_ok: "0x70"}, "45m", []),
        # 80 pages refused once (a writer's umask 022): it fires, and is quiet 15m on.
        alert_test(
            "CachemgrGCRefusedFiles",
            {refused: "0 0 80x10"},
            "5m",
            [expect("CachemgrGCRefusedFiles", refused_labels, 80)],
        ),
        alert_test("CachemgrGCRefusedFiles", {refused: "0 0 80x30"}, "25m", []),
        # Runs end over the floor for 10 minutes: it fires; one such run between good ones
        # (a burst GC caught up with) does not.
        alert_test(
            "CachemgrGCLimitNotHeld",
            {unmet: "0 0 1x15"},
            "14m",
            [expect("CachemgrGCLimitNotHeld", unmet_labels, 1)],
        ),
        alert_test("CachemgrGCLimitNotHeld", {unmet: "0 0 1 0x15"}, "14m", []),
        alert_test(
            "CachemgrWatcherOverflow",
            {overflows: "0 0 0 1 1 1"},
            "4m",
            [expect("CachemgrWatcherOverflow", node, 1)],
        ),
        alert_test("CachemgrWatcherOverflow", {overflows: "0x20"}, "15m", []),
        # A namespace short of watches for 15m fires, and so does <root>/ns refused its own
        # with no namespace short; one watched in full after 10m does not.
        alert_test(
            "CachemgrWatchLimitReached",
            {short: "0 0 1x20", root_short: "0x22"},
            "18m",
            [expect("CachemgrWatchLimitReached", node, 1)],
        ),
        alert_test(
            "CachemgrWatchLimitReached",
            {short: "0x22", root_short: "0 0 1x20"},
            "18m",
            [expect("CachemgrWatchLimitReached", node, 1)],
        ),
        alert_test(
            "CachemgrWatchLimitReached", {short: "0 0 1x10 0x10", root_short: "0x22"}, "18m", []
        ),
        alert_test(
            "CachemgrPageSizeOne",
            {info: "1x3"},
            "2m",
            [expect("CachemgrPageSizeOne", info_labels, 1)],
        ),
        alert_test("CachemgrPageSizeOne", {target(info_sample): "1x3"}, "2m", []),
        alert_test(
            "CachemgrCacheWriteOnly",
            {pages: "100+10x90", reads: "0x90"},
            "70m",
            [expect("CachemgrCacheWriteOnly", {**ns, "engine": "sglang"})],
        ),
        alert_test("CachemgrCacheWriteOnly", {pages: "100+10x90", reads: "0+1x90"}, "70m", []),
        alert_test(
            "CachemgrCacheWriteOnly",
            {v_pages: "100+10x90", v_reads: "0x90", pages: "100+10x90", reads: "0+1x90"},
            "70m",
            [expect("CachemgrCacheWriteOnly", vns)],
        ),
        alert_test("CachemgrCacheWriteOnly", {v_pages: "100+10x90", v_reads: "0+1x90"}, "70m", []),
        # vLLM namespaces have no page_size; one labelled 1 is still not SGLang's problem.
        alert_test("CachemgrPageSizeOne", {v_info: "1x3"}, "2m", []),
        # A day of 75% hits, then none for 5 hours while writes go on: collapsed, unless purged.
        alert_test(
            "CachemgrHitRatioCollapsed",
            {reads: "0+30x150 4500x30", writes: "0+10x180"},
            "28h",
            [expect("CachemgrHitRatioCollapsed", {**node, "engine": "sglang"}, 0)],
            interval="10m",
        ),
        # vLLM's ratio collapses while SGLang's namespaces keep hitting: vLLM's alone fires.
        alert_test(
            "CachemgrHitRatioCollapsed",
            {
                v_reads: "0+30x150 4500x30",
                v_writes: "0+10x180",
                reads: "0+30x180",
                writes: "0+10x180",
            },
            "28h",
            [expect("CachemgrHitRatioCollapsed", {**node, "engine": "vllm"}, 0)],
            interval="10m",
        ),
        alert_test(
            "CachemgrHitRatioCollapsed",
            {reads: "0+30x150 4500x30", writes: "0+10x180", purges: "0x160 1x20"},
            "28h",
            [],
            interval="10m",
        ),
        alert_test(
            "CachemgrHitRatioCollapsed", {reads: "0+30x180", writes: "0+10x180"}, "28h", [], "10m"
        ),
    ]
    alerts = {r["alert"] for g in load_rules() for r in g["rules"] if "alert" in r}
    assert {t["alert_rule_test"][0]["alertname"] for t in tests} == alerts
    tests += [alert_test(name, at_rest, "25m", []) for name in sorted(alerts)]
    run_promtool_tests(tmp_path, tests)


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric, label matchers) of every `metric{...}` selector in `expr`."""
    return re.findall(r"([a-zA-Z_:][\w:]*)\{([^}]*)\}", expr)


def panel_expr(dashboard: dict[str, Any], title: str) -> str:
    (panel,) = [p for p in dashboard["panels"] if p["title"] == title]
    expr: str = panel["targets"][0]["expr"]
    return expr


def test_every_per_namespace_query_filters_on_engine(scrapes: Live) -> None:
    """The `engine` variable lists the daemon's engines and narrows every query of a series that
    has an engine label; three panels break pages, bytes and hit ratio down by engine."""
    per_ns = {s.name for s in scrapes.second.samples if "engine" in dict(s.labels)}
    assert {"cachemgr_namespace_pages", "cachemgr_page_reads_total"} <= per_ns
    dashboard = json.loads(DASHBOARD.read_text())
    (var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "engine"]
    assert var["query"]["query"] == (
        'label_values(cachemgr_namespace_pages{job="cachemgr", instance=~"$instance"}, engine)'
    )
    filtered = 0
    for where, expr in dashboard_exprs(dashboard):
        for name, matchers in selectors(expr):
            if name in per_ns and where != "$engine":
                assert 'engine=~"$engine"' in matchers, f"{where}: {name}{{{matchers}}}"
                filtered += 1
    assert filtered >= 15
    by_engine = [p for p in dashboard["panels"] if "by engine" in p["title"]]
    assert len(by_engine) == 3
    for p in by_engine:
        (t,) = p["targets"]
        assert t["expr"].startswith("sum by (engine)") and t["legendFormat"] == "{{engine}}"


def test_dashboard_queries_on_a_real_prometheus_show_the_vllm_namespace(scrapes: Live) -> None:
    """Prometheus scraping the daemon (deploy/'s rules loaded) answers every dashboard query, and
    the per-engine panels and the engine filter show the vLLM namespace's blocks and hits."""
    url, dashboard = scrapes.prometheus, json.loads(DASHBOARD.read_text())
    for _, expr in dashboard_exprs(dashboard):
        prom_query(url, fill_in(expr))  # a query Prometheus refuses fails here

    def by_engine(title: str) -> dict[str, float]:
        result = prom_query(url, fill_in(panel_expr(dashboard, title)))
        return {r["metric"]["engine"]: float(r["value"][1]) for r in result}

    (var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "engine"]
    engines = prom_query(url, fill_in(var["query"]["query"]))
    assert {r["metric"]["engine"] for r in engines} == {"sglang", "vllm"}
    wait_for(
        lambda: by_engine("Pages by engine"),
        lambda v: v == {"sglang": 10, "vllm": 6},
        timeout=30,
        what="the last scrape in Prometheus",
    )
    assert by_engine("Bytes by engine")["vllm"] == 6 * 4096
    ratio = by_engine("Page hit ratio by engine (reads / (reads + writes))")
    assert ratio == {"sglang": pytest.approx(2 / 8), "vllm": pytest.approx(2 / 5)}
    only_vllm = fill_in(panel_expr(dashboard, "Pages per namespace"), engine="vllm")
    assert [r["metric"]["namespace"] for r in prom_query(url, only_vllm)] == [scrapes.vllm_ns]
    recorded = prom_query(url, 'namespace:cachemgr_page_hit_ratio:rate5m{engine="vllm"}')
    assert [(r["metric"]["namespace"], float(r["value"][1])) for r in recorded] == [
        (scrapes.vllm_ns, pytest.approx(2 / 5))
    ]
