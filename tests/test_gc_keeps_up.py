"""Cap-keeping at SGLang's full write rate (issue #13): GC is woken by page stores the index has
not applied yet and counts them; a run with nothing to free does not deafen GC to the next
wake; pages in flight that the index has not seen stay with their ancestors; pages written
behind a deletion go first; a /metrics scrape runs no SQL."""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from pathlib import Path

from cachemgr.daemon.backlog import Flight, StoreBacklog, queued_pages
from cachemgr.daemon.watcher import Event, Watcher
from cachemgr.fs.root import create_root
from cachemgr.fs.usage import DiskUsage
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.execute import execute_gc
from cachemgr.gc.policy import GcPolicy, headroom, over_limits
from cachemgr.gc.runner import GcRunner
from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from cachemgr.sglang.hicache import HICACHE_FILE
from tests.daemon_helpers import NS_A, page_name, register_namespace, running_daemon, store_page
from tests.gc_helpers import NS, T0, Tree, big_disk, evicted, page, policy
from tests.polling import wait_for
from tests.test_chains import KEY_LEN, SUFFIX, Stream, key, order
from tests.test_server import metric

PAGE = 1000


def page_bytes(d: Path) -> int:
    """Bytes of the page files in `d` (GC may delete some meanwhile)."""
    total = 0
    with os.scandir(d) as entries:
        for e in entries:
            with contextlib.suppress(FileNotFoundError):
                total += e.stat().st_size if e.name.endswith(".bin") else 0
    return total


def test_stores_the_index_has_not_applied_wake_gc_and_count_against_the_cap(
    tmp_path: Path,
) -> None:
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    d = register_namespace(layout, NS_A, instance="gpu0")
    for i in range(900):  # 0.9 of the cap, indexed by the start-up scan
        store_page(d, page_name(i), PAGE)
    settings = load_settings(
        root=layout.root, gc_max_bytes=1_000_000, gc_high_watermark=1.0,
        gc_low_watermark=0.9, gc_min_age=0, gc_interval=3600, gc_delete_rate=1e9,
        batch_interval=10,  # the index applies nothing before the wait below ends
    )  # fmt: skip
    with running_daemon(settings) as dm:
        for i in range(900, 1200):  # 1.2 of the cap on disk
            store_page(d, page_name(i), PAGE)
        # Only the stores' count on the inotify thread can wake GC, and only counting them
        # can show it that it is over the cap: the index has not applied one of them.
        wait_for(lambda: page_bytes(d), lambda b: b <= 1_000_000, timeout=8, what="the cap")
        assert dm.daemon.indexer.state.events_applied == 0
        assert all((d / page_name(i)).exists() for i in range(900, 1200))  # the old went


def test_a_run_with_nothing_to_free_does_not_pause_gc(tmp_path: Path) -> None:
    tree = Tree.at(tmp_path / "root")
    tree.write(NS, [page(i) for i in range(10)], at=T0)
    under = policy(max_bytes=100_000)
    runner = GcRunner(tree.layout, tree.store, under, disk_usage=big_disk)
    try:
        # The daemon's first tick sweeps and finds nothing to free: no reason to ignore the
        # wakes of a writer that crosses the high watermark next.
        assert runner._cycle(runner.tick) is False
        # Over the cap with every page too young to go: the cap wins, the run frees them.
        runner.policy = policy(max_bytes=5000, min_age=10 * 365 * 86400.0)
        assert runner._cycle(runner.tick) is False
        assert runner.stats.overridden == 6
        # Stores the index has not applied yet put it over: protections yield only for what
        # the index counts (the model does not know what those stores continue), so nothing
        # can go until it applies them: that run is stuck, and GC pauses.
        runner.pending = lambda: 10**9
        assert runner._cycle(runner.tick) is True
    finally:
        runner.leadership.release()
        tree.store.close()


def test_pages_accessed_but_not_applied_stay_with_their_ancestors(tmp_path: Path) -> None:
    tree = Tree.at(tmp_path / "root")
    try:
        tree.write(NS, [page(1), page(2), page(3)], at=T0)  # one chain: 1 <- 2 <- 3
        tree.write(NS, [page(10)], at=T0)
        model = ChainModel.from_index(tree.store.conn, [NS])
        cap = policy(max_bytes=2500)  # two pages must go
        busy = {(NS, page(2)[:64])}
        # A request just read page 2 (its event is queued, not applied): 2 and 1 stay; 3, a
        # tail that request did not reach, may go.
        got = evicted(tree.plan(cap, now=T0 + 100, model=model, busy=busy))
        assert sorted(got) == sorted([page(3), page(10)])
        # All must go: the cap wins, the busy chain goes last, tail first.
        cap = policy(max_bytes=100, high_watermark=0.5, low_watermark=0.1)
        plan = tree.plan(cap, now=T0 + 100, model=model, busy=busy)
        assert evicted(plan)[2:] == [page(2), page(1)] and plan.overridden == 2
    finally:
        tree.store.close()


def test_queued_pages_are_the_reads_and_stores_not_applied(tmp_path: Path) -> None:
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    d = layout.ns_dir(NS_A)
    d.mkdir()
    store_page(d, page_name(1))
    store_page(d, page_name(3))
    watcher = Watcher(layout)
    watcher.start()
    try:
        assert watcher.watch(NS_A)
        with open(d / page_name(1), "rb") as f:  # a read (HiCacheFile.get)
            f.read()
        store_page(d, page_name(2))  # a store
        os.unlink(d / page_name(3))  # a deletion: not an access
        q: deque[Event] = wait_for(lambda: watcher.queue, lambda q: len(q) >= 3)
        got = queued_pages(q, lambda ns: HICACHE_FILE)
    finally:
        watcher.stop()
    assert got == {(NS_A, page_name(1)[:64]), (NS_A, page_name(2)[:64])}


def test_pages_written_behind_a_deletion_go_first() -> None:
    model = ChainModel()
    s = Stream(model)
    s.request([], [10])  # an old chain, quiet since
    for _ in range(3):
        s.request([10], [])
    s.request([], [1, 2, 3, 4])  # one request, just now: 1 <- 2 <- 3 <- 4, never read yet
    # A deletion raced that request (GC picked 2 before the request read or wrote past it):
    # 3 and 4 can never be loaded, though no read confirmed their links.
    model.remove("ns", [(key(2) + SUFFIX, KEY_LEN)])
    got = order(model)
    assert got[:2] == [4, 3]


def test_a_scrape_runs_no_sql(tmp_path: Path) -> None:
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    d = register_namespace(layout, NS_A, instance="gpu0")
    store_page(d, page_name(0))
    with running_daemon(load_settings(root=layout.root, batch_interval=0.05)) as dm:
        by_thread: list[str] = []
        with dm.daemon.reader() as conn:  # the connection scrapes read through before
            conn.set_trace_callback(lambda _: by_thread.append(threading.current_thread().name))
        for i in range(1, 5):
            store_page(d, page_name(i))
        # What the index applied shows soon (the refresher is told after each batch) ...
        text = wait_for(
            lambda: dm.get("/metrics").text,
            lambda t: metric(t, "cachemgr_namespace_pages", namespace=NS_A) == 5,
        )
        assert metric(text, "cachemgr_ready") == 1
        # ... and no scrape ran a statement: only the refresher's thread did.
        for _ in range(20):
            assert dm.get("/metrics").status_code == 200
        with dm.daemon.reader() as conn:
            conn.set_trace_callback(None)
    assert by_thread and set(by_thread) == {"cachemgr-metrics"}


def test_the_writers_pace_starts_a_run_early_but_deepens_it_by_half_the_gap() -> None:
    cap = GcPolicy(max_bytes=1000, high_watermark=1.0, low_watermark=0.9)  # a gap of 100 bytes
    disk = DiskUsage(10**12, 10**11, 10**11)
    # 80 bytes will come while GC runs: at 930 it must start, and it goes down to 900 - 50.
    assert over_limits(cap, {"ns": 930}, disk, ahead=80).root == 80
    assert headroom(cap, 930, disk, ahead=80) == -10
    assert over_limits(cap, {"ns": 910}, disk, ahead=80).root is None
    # Stored but not indexed yet: on disk already, counted whole.
    assert over_limits(cap, {"ns": 800}, disk, pending=250).root == 150


def test_a_chain_a_request_reads_while_gc_deletes_stays_from_the_next_chunk_on(
    tmp_path: Path,
) -> None:
    tree = Tree.at(tmp_path / "root")
    watcher = Watcher(tree.layout)
    try:
        tree.write(NS, [page(i) for i in range(1, 7)], at=T0)  # one chain: 1 <- 2 <- ... <- 6
        model = ChainModel.from_index(tree.store.conn, [NS])
        plan = tree.plan(policy(max_bytes=100, low_watermark=0.1), now=T0 + 100, model=model)
        assert evicted(plan) == [page(i) for i in range(6, 0, -1)]  # tail first, all of it
        watcher.start()
        assert watcher.watch(NS)
        flight = Flight(watcher, model)()  # taken when GC plans
        # After the plan a request looks the chain up (a stat: no event) and reads it head to
        # tail; GC has not deleted a chunk yet. Page 3 was read: it and its prefix stay.
        with open(tree.layout.ns_dir(NS) / page(3), "rb") as f:
            f.read()
        wait_for(lambda: watcher.accessed, bool)
        execute_gc(plan, tree.layout, tree.store, clock=lambda: T0 + 100, keep=flight.keep)
    finally:
        watcher.stop()
        tree.store.close()
    assert tree.files(NS) == {page(1), page(2), page(3)}


def test_only_each_streams_last_page_read_since_the_plan_is_kept(tmp_path: Path) -> None:
    """Not every page read since the plan holds its chain (at full speed that was every
    chain, and the cap was lost: run F): a request that read a chain and then another
    request on the same stream is done with it."""
    tree = Tree.at(tmp_path / "root")
    watcher = Watcher(tree.layout)
    try:
        tree.write(NS, [page(i) for i in range(1, 7)], at=T0)  # 1 <- 2 <- ... <- 6
        tree.write(NS, [page(i) for i in range(11, 17)], at=T0 + 1)  # 11 <- ... <- 16
        model = ChainModel.from_index(tree.store.conn, [NS])
        plan = tree.plan(policy(max_bytes=100, low_watermark=0.1), now=T0 + 100, model=model)
        assert len(evicted(plan)) == 12
        watcher.start()
        assert watcher.watch(NS)
        flight = Flight(watcher, model)()
        for n in (3, 13):  # one request read up to 3, the next one up to 13
            with open(tree.layout.ns_dir(NS) / page(n), "rb") as f:
                f.read()
        wait_for(lambda: watcher.accessed, lambda n: n >= 2)
        execute_gc(plan, tree.layout, tree.store, clock=lambda: T0 + 100, keep=flight.keep)
    finally:
        watcher.stop()
        tree.store.close()
    assert tree.files(NS) == {page(11), page(12), page(13)}


def test_a_limit_still_crossed_after_a_stuck_run_is_tried_again_without_a_wake(
    tmp_path: Path,
) -> None:
    """Every page too young to go (min_age): the run frees nothing and GC pauses. The writer
    has stopped, so nothing wakes GC again; once the pages are old enough, the retry after the
    pause frees them, not the next interval an hour later."""
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    d = register_namespace(layout, NS_A, instance="gpu0")
    cfg = load_settings(root=layout.root, batch_interval=0.05, gc_interval=3600,
                        gc_max_bytes=4096, gc_min_age=1.0, gc_delete_rate=None)  # fmt: skip
    with running_daemon(cfg):
        for i in range(8):
            store_page(d, page_name(i))
        wait_for(lambda: page_bytes(d), lambda b: b <= 4096, timeout=30, what="the retry")


def test_stores_seen_during_a_gc_run_past_the_room_it_leaves_wake_gc_again() -> None:
    """The watcher's wake sets the room to infinity until the next check; stores seen while the
    run goes on cannot wake GC. When the run re-arms the room and they are past it already,
    they wake GC at once: no later store may come (a writer that stopped)."""
    wakes: list[int] = []
    backlog = StoreBacklog(wake=lambda: wakes.append(backlog.seen))
    backlog.done(0, PAGE)
    backlog.rearm(100 * PAGE)  # after the start-up scan's check
    for _ in range(300):  # the writer's burst; GC is woken once, at the 101st store
        backlog.stored()
    assert wakes == [101]
    backlog.rearm(200 * PAGE)  # the run freed room for 200 pages: 300 are pending
    assert wakes == [101, 300]
    backlog.rearm(400 * PAGE)  # room enough: no wake
    assert wakes == [101, 300]
