from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from cachemgr.daemon.index_state import Counters, IndexState
from cachemgr.daemon.metrics import METRICS, CachemgrCollector, Parts
from cachemgr.fs.leadership import Leadership
from cachemgr.fs.usage import DiskUsage
from cachemgr.gc.policy import GcPolicy
from cachemgr.gc.runner import GcRunner
from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from cachemgr.state.index import scan_namespace
from cachemgr.state.store import Store
from tests.daemon_helpers import NS_A, page_name, register_namespace, running_daemon, store_page
from tests.polling import wait_for


def registry_for(
    layout: Layout, store: Store, index: IndexState | None = None
) -> CollectorRegistry:
    @contextmanager
    def reader() -> Iterator[sqlite3.Connection]:
        yield store.conn

    reg = CollectorRegistry(auto_describe=False)
    reg.register(
        CachemgrCollector(
            layout,
            reader,
            Parts(index=index),
            disk=lambda _: DiskUsage(total=5000, used=4000, free=1000, free_inodes=7),
        )
    )
    return reg


def test_values_come_from_the_index_the_audit_log_and_the_disk(layout: Layout) -> None:
    d = register_namespace(layout, NS_A, instance="gpu0")
    for i in range(3):
        store_page(d, page_name(i), 100)
    store = Store.open(layout.db_path)
    scan_namespace(layout, store, NS_A)
    state = IndexState(counters={NS_A: Counters(reads=5, writes=2)})
    state.live(True, pending="its model of the pages is loaded")
    reg = registry_for(layout, store, state)
    v = reg.get_sample_value
    assert v("cachemgr_ready") == 1 and v("cachemgr_index_settled") == 0  # (GC waits)
    state.settle()
    assert v("cachemgr_index_settled") == 1
    assert v("cachemgr_namespace_pages", {"namespace": NS_A, "engine": "sglang"}) == 3
    assert v("cachemgr_namespace_bytes", {"namespace": NS_A, "engine": "sglang"}) == 300
    assert v("cachemgr_page_reads_total", {"namespace": NS_A, "engine": "sglang"}) == 5
    assert v("cachemgr_page_writes_total", {"namespace": NS_A, "engine": "sglang"}) == 2
    assert v("cachemgr_ready") == 1 and v("cachemgr_filesystem_avail_bytes") == 1000
    assert v("cachemgr_purges_total", {"reason": "manual"}) is None
    with store.transaction():
        store.audit("purge", namespace_id=NS_A, reason="manual", actor="cli", pages=3, bytes_=300)
        store.audit("evict", namespace_id=NS_A, reason="cap", actor="auto", pages=2, bytes_=200)
        store.audit("evict", namespace_id=NS_A, reason="cap", actor="auto", pages=1, bytes_=100)
    assert v("cachemgr_purges_total", {"reason": "manual"}) == 1
    assert v("cachemgr_purged_bytes_total", {"reason": "manual"}) == 300
    assert v("cachemgr_evicted_pages_total", {"reason": "cap"}) == 3
    with store.transaction():  # read incrementally: only new rows are added on the next scrape
        store.audit("evict", namespace_id=NS_A, reason="cap", actor="cli", pages=4, bytes_=400)
    assert v("cachemgr_evicted_bytes_total", {"reason": "cap"}) == 700
    store.close()


def test_every_exposed_metric_is_documented(layout: Layout) -> None:
    store = Store.open(layout.db_path)
    state = IndexState()
    names = {m.name for m in registry_for(layout, store, state).collect()}
    store.close()
    documented = {n.removesuffix("_total").removesuffix("_info") for n in METRICS}
    assert names - documented == set()


def test_gc_metrics_follow_the_runner(layout: Layout) -> None:
    """Leadership, runs by result and the last success come from the daemon's GcRunner."""
    store = Store.open(layout.db_path)
    clock = [1000.0]
    runner = GcRunner(layout, store, GcPolicy(min_free_percent=0.0), clock=lambda: clock[0])

    @contextmanager
    def reader() -> Iterator[sqlite3.Connection]:
        yield store.conn

    reg = CollectorRegistry(auto_describe=False)
    reg.register(CachemgrCollector(layout, reader, Parts(gc=runner)))
    v = reg.get_sample_value
    assert v("cachemgr_gc_leader") == 0
    assert v("cachemgr_gc_last_success_timestamp_seconds") == 1000.0  # started, nothing yet
    other = Leadership(layout.state_dir / "gc.lock")
    assert other.try_acquire()
    assert runner.tick() is None
    assert v("cachemgr_gc_runs_total", {"result": "skipped"}) == 1
    other.release()
    clock[0] = 2000.0
    runner.tick()  # first tick: a sweep, so a run
    assert v("cachemgr_gc_leader") == 1
    assert v("cachemgr_gc_runs_total", {"result": "ok"}) == 1
    assert v("cachemgr_gc_last_success_timestamp_seconds") == 2000.0
    clock[0] = 2060.0
    assert runner.tick() is None  # nothing to do: a success, not a run
    assert v("cachemgr_gc_runs_total", {"result": "ok"}) == 1
    assert v("cachemgr_gc_last_success_timestamp_seconds") == 2060.0

    def broken(_: object) -> tuple[int, int, int]:
        raise OSError(5, "Input/output error")

    runner.disk_usage = broken
    with pytest.raises(OSError):
        runner.tick()
    assert v("cachemgr_gc_runs_total", {"result": "error"}) == 1
    assert v("cachemgr_gc_last_success_timestamp_seconds") == 2060.0
    runner.leadership.release()
    store.close()


def test_a_scrape_of_the_real_daemon_has_no_created_series(layout: Layout) -> None:
    """`*_created` gauges are noise for dashboards; the counters themselves stay."""
    d = register_namespace(layout, NS_A, instance="gpu0")
    store_page(d, page_name(1), 100)
    with running_daemon(load_settings(root=layout.root)) as dm:
        assert dm.post("/v1/gc").status_code == 200  # counters with a sample each
        wait_for(lambda: dm.get("/metrics").text, lambda t: "cachemgr_scans_total" in t)
        text = dm.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    counters = [name for name, f in families.items() if f.type == "counter"]
    assert "cachemgr_scans" in counters and "cachemgr_page_reads" in counters, sorted(families)
    created = [line for line in text.splitlines() if "_created" in line]
    assert created == [], created
