"""GC inside the running daemon: leadership, the watermark wake, POST /v1/gc, GC metrics, and
/metrics answering while GC evicts."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from cachemgr.fs.leadership import Leadership
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from tests.daemon_helpers import (
    NS_A,
    page_name,
    register_namespace,
    running_daemon,
    store_page,
)
from tests.nsfixtures import cli_process
from tests.polling import wait_for
from tests.test_server import metric

PAGE = 1000
TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _root(tmp_path: Path, pages: int) -> tuple[Layout, Path]:
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    d = register_namespace(layout, NS_A, instance="gpu0")
    for i in range(pages):
        store_page(d, page_name(i), PAGE)
    return layout, d


def _write_for_seconds(d: Path, numbers: range) -> None:
    """The pages at 1,000/s in bursts of 100: eviction spans seconds of scrapes, not one."""
    for i in numbers:
        store_page(d, page_name(i), PAGE)
        if i % 100 == 99:
            time.sleep(0.1)


def test_eviction_woken_by_writes_while_metrics_keep_answering(tmp_path: Path) -> None:
    """Writes push the index past the cap's high watermark: the indexer wakes GC at once (the
    interval is an hour), it evicts paced down to the low watermark, and every /metrics
    scrape meanwhile answers 200, some of them mid-eviction."""
    layout, d = _root(tmp_path, 1000)
    settings = load_settings(
        root=layout.root,
        gc_max_bytes=2_000_000,
        gc_min_age=0,
        gc_interval=3600,
        gc_delete_rate=2000,
        batch_interval=0.05,
    )
    with running_daemon(settings) as dm:
        # Scrapes go on while the writer writes: the cap is kept as it goes (the burst is one
        # request's chain, in flight, which yields to the cap), not after it stopped.
        writer = threading.Thread(target=_write_for_seconds, args=(d, range(1000, 4000)))
        writer.start()
        seen: list[float | None] = []  # the evictions each scrape counted

        def scrape() -> tuple[str, float | None, float | None]:
            r = dm.get("/metrics")
            assert r.status_code == 200
            pages = metric(r.text, "cachemgr_namespace_pages", namespace=NS_A)
            evicted = metric(r.text, "cachemgr_evicted_pages_total", reason="cap")
            seen.append(evicted)
            return r.text, pages, evicted

        def settled(got: tuple[str, float | None, float | None]) -> bool:
            """Under the high watermark, the index agrees with the disk and every eviction is
            audited (a chunk's files go before its audit row is written)."""
            _, pages, evicted = got
            return (
                pages is not None
                and pages <= 1900
                and pages == len(os.listdir(d))
                and evicted == 4000 - pages
            )

        # The writer's 3 s at 1,000 pages/s stretch past 10 s on a loaded box: this wait is
        # for the writer, not a claim about the daemon.
        wait_for(
            lambda: (scrape(), writer.is_alive())[1],
            lambda alive: not alive,
            timeout=60,
            every=0.02,
            what="the writer",
        )
        text, pages, evicted = wait_for(
            scrape, settled, timeout=60, every=0.02, what="GC to evict under the high watermark"
        )
        assert pages is not None and evicted is not None
        # An eviction count strictly between none and the last: a scrape was answered while GC
        # evicted, not queued behind it (the page count need not pass the low watermark: GC
        # starts early by the writer's pace). Scrape latency is a benchmark's (bench_daemon.py).
        assert any(e is not None and 0 < e < evicted for e in seen), "no scrape during eviction"
        assert metric(text, "cachemgr_gc_leader") == 1
        assert metric(text, "cachemgr_evicted_pages_total", reason="cap") == 4000 - pages
        # Under the high watermark (1900 pages of 1 kB), and a run evicts down to the low one
        # (1700), less what it expects the writer to add before it is done (a few batches of
        # these writes at most). Each chain the writes were learned as goes tail first, so
        # what stays of it is a prefix: no page left behind a page gone.
        assert pages >= 1500
        left = {n[:64] for n in os.listdir(d)}
        model = dm.daemon.indexer.model
        preds = {k: p.pred for (_, k), p in model.pages.items()}
        assert preds.keys() == left
        assert all(p is None or p in left for p in preds.values())


def test_gc_route_needs_the_token_and_the_leadership(tmp_path: Path) -> None:
    layout, d = _root(tmp_path, 10)
    other = Leadership(layout.state_dir / "gc.lock")
    assert other.try_acquire()  # another daemon on this root leads GC
    try:
        # A run an hour apart: the start-up run is skipped, and after the release no run of
        # the daemon's own can lead and drain the trash entry before the POST does.
        settings = load_settings(root=layout.root, token=TOKEN, gc_interval=3600)
        with running_daemon(settings) as dm:
            assert dm.post("/v1/gc").status_code == 401
            text = wait_for(
                lambda: dm.get("/metrics").text,
                lambda t: (metric(t, "cachemgr_gc_runs_total", result="skipped") or 0) > 0,
            )
            assert metric(text, "cachemgr_gc_leader") == 0
            r = dm.post("/v1/gc", headers=AUTH)
            assert r.status_code == 409
            assert r.headers["content-type"] == "application/problem+json"
            assert "another process leads GC" in r.json()["detail"]
            dry = dm.post("/v1/gc", params={"dry_run": "true"}, headers=AUTH)
            assert dry.status_code == 200 and dry.json()["dry_run"] is True
            other.release()
            (layout.trash / f"{NS_A}.abc").mkdir()
            store_page(layout.trash / f"{NS_A}.abc", page_name(1), PAGE)
            r = dm.post("/v1/gc", json={"dry_run": False}, headers=AUTH)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["leader"] is True and body["by_reason"]["trash"]["files"] == 1
            assert not (layout.trash / f"{NS_A}.abc").exists()
            assert len(list(d.iterdir())) == 10  # no cap: pages stay
            wait_for(lambda: metric(dm.get("/metrics").text, "cachemgr_gc_leader"), bool)
    finally:
        other.release()


def test_purge_over_http_is_drained_by_gc(tmp_path: Path) -> None:
    """One owner of .trash/: the purge wakes GC, whose trash step deletes and audits it."""
    layout, _ = _root(tmp_path, 20)
    with running_daemon(load_settings(root=layout.root, gc_interval=3600)) as dm:
        # GC's start-up run is over (else it, not a wake, could drain the purge)
        wait_for(lambda: metric(dm.get("/metrics").text, "cachemgr_gc_runs_total", result="ok"))
        r = dm.post("/v1/purge", json={"namespace": NS_A})
        assert r.status_code == 200
        wait_for(lambda: list(layout.trash.iterdir()), lambda left: not left)
        wait_for(  # the audit's sums come from a snapshot refreshed soon after
            lambda: dm.get("/metrics").text,
            lambda t: (
                (metric(t, "cachemgr_gc_runs_total", result="ok") or 0) >= 2
                and metric(t, "cachemgr_purged_pages_total", reason="manual") == 20
            ),
        )
    assert not any(layout.ns_dir(NS_A).iterdir())


def test_a_purge_by_the_cli_wakes_the_daemons_gc(tmp_path: Path) -> None:
    """Another process renames ns/<id> into .trash/: the watcher sees it leave, GC drains it."""
    layout, _ = _root(tmp_path, 20)
    with running_daemon(load_settings(root=layout.root, gc_interval=3600)) as dm:
        wait_for(lambda: dm.namespaces()[NS_A]["pages"], lambda n: n == 20)
        out = cli_process(
            "--root", str(layout.root), "purge", "--namespace", NS_A, "--yes", "--no-wait"
        )
        assert out.returncode == 0, out.stderr
        # an hour-long interval: only a wake gets the trash deleted within the wait
        wait_for(lambda: list(layout.trash.iterdir()), lambda left: not left, timeout=20)
        wait_for(  # the audit's sums come from a snapshot refreshed soon after
            lambda: dm.get("/metrics").text,
            lambda t: metric(t, "cachemgr_purged_pages_total", reason="manual") == 20,
        )


def test_a_second_daemon_on_the_root_follows_for_the_index_and_gc(tmp_path: Path) -> None:
    layout, _ = _root(tmp_path, 5)
    settings = load_settings(root=layout.root, gc_interval=0.1)
    with running_daemon(settings) as first, running_daemon(settings) as second:
        wait_for(lambda: metric(first.get("/metrics").text, "cachemgr_gc_leader"), bool)
        # The follower's GC loop has run and found gc.lock taken, more than once.
        text = wait_for(
            lambda: second.get("/metrics").text,
            lambda t: (metric(t, "cachemgr_gc_runs_total", result="skipped") or 0) >= 2,
            what="the follower's GC cycles",
        )
        assert metric(text, "cachemgr_index_leader") == 0
        assert metric(text, "cachemgr_gc_leader") == 0
        assert metric(first.get("/metrics").text, "cachemgr_index_leader") == 1
        assert second.status()["index"]["leader"] is False
        assert second.namespaces()[NS_A]["pages"] == 5  # served from the leader's index
