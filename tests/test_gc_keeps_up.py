"""Cap-keeping at SGLang's full write rate (issue #13): GC is woken by page stores the index has
not applied yet and counts them; a run with nothing to free does not deafen GC to the next
wake; pages in flight that the index has not seen stay with their ancestors; pages written
behind a deletion go first; a /metrics scrape runs no SQL."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from cachemgr.daemon.backlog import SETTLE, Flight, StoreBacklog, queued_pages
from cachemgr.daemon.events import LOCAL, Kind
from cachemgr.daemon.gcapi import GcResponse
from cachemgr.daemon.watcher import Event, Watcher
from cachemgr.formats import DEFAULT_FORMAT
from cachemgr.fs.deletion import Pacer
from cachemgr.fs.root import create_root
from cachemgr.fs.usage import DiskUsage
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.execute import InFlight, execute_gc
from cachemgr.gc.plan import GcPlan, Live, plan_gc
from cachemgr.gc.policy import GcPolicy, headroom, over_limits, room
from cachemgr.gc.runner import GcRunner, LiveState
from cachemgr.gc.told import forgetting
from cachemgr.layout import Layout
from cachemgr.ns.purge import purge
from cachemgr.settings import Settings, load_settings
from cachemgr.sglang.hicache import HICACHE_FILE
from cachemgr.state.store import Store
from tests.daemon_helpers import (
    NS_A,
    NS_B,
    page_name,
    register_namespace,
    running_daemon,
    store_page,
)
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
        root=layout.root,
        gc_max_bytes=1_000_000,
        gc_high_watermark=1.0,
        gc_low_watermark=0.9,
        gc_min_age=0,
        gc_interval=3600,
        gc_delete_rate=1e9,
        batch_interval=10,  # the index applies nothing before the wait below ends
    )
    with running_daemon(settings) as dm:
        for i in range(900, 1200):  # 1.2 of the cap on disk
            store_page(d, page_name(i), PAGE)
        # Only the stores' count on the inotify thread can wake GC, and only counting them
        # can show it that it is over the cap: the index has not applied one of them.
        wait_for(lambda: page_bytes(d), lambda b: b <= 1_000_000, timeout=8, what="the cap")
        assert dm.daemon.indexer.state.events_applied == 0
        assert all((d / page_name(i)).exists() for i in range(900, 1200))  # the old went


class Pending(LiveState):
    """A daemon whose watcher saw `stored` bytes the index has not applied."""

    def __init__(self, stored: int) -> None:
        super().__init__()
        self.stored = stored

    def pending(self) -> int:
        return self.stored


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
        runner.live = Pending(10**9)
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
            timeout=30,  # (which thread reads is the claim, not how soon: 10 s failed under load)
        )
        assert metric(text, "cachemgr_ready") == 1
        # ... and no scrape ran a statement: only the refresher's thread did.
        for _ in range(20):
            assert dm.get("/metrics").status_code == 200
        with dm.daemon.reader() as conn:
            conn.set_trace_callback(None)
    # (GC's thread reads through it too, after a run: its rearm, not a scrape's; a periodic
    # run fell in this window on a loaded CI machine)
    assert by_thread and set(by_thread) - {"cachemgr-gc"} == {"cachemgr-metrics"}


def test_the_writers_pace_starts_a_run_early_but_deepens_it_by_half_the_gap() -> None:
    cap = GcPolicy(max_bytes=1000, high_watermark=1.0, low_watermark=0.9)  # a gap of 100 bytes
    disk = DiskUsage(10**12, 10**11, 10**11)
    # 80 bytes will come while GC runs: at 930 it must start, and it goes down to 900 - 50.
    assert over_limits(cap, {"ns": 930}, disk, ahead=80).root == 80
    assert headroom(cap, 930, disk, ahead=80) == -10
    assert over_limits(cap, {"ns": 910}, disk, ahead=80).root is None
    # Stored but not indexed yet: on disk already, counted whole.
    assert over_limits(cap, {"ns": 800}, disk, pending=250).root == 150


def test_what_requests_reach_while_gc_deletes_keeps_the_gap_less_the_writers_pace(
    tmp_path: Path,
) -> None:
    """Pages spared at execution may keep what the plan frees between the high watermark
    and the low one, less what the writer's pace deepens a run by (policy.over_limits)."""
    cap = GcPolicy(max_bytes=1000, high_watermark=1.0, low_watermark=0.9)  # a gap of 100
    assert [room(cap, 1000, ahead=a) for a in (0, 40, 80, 500)] == [100, 100, 70, 50]
    assert room(cap, float("inf")) == 0
    tree = Tree.at(tmp_path / "root")
    try:
        tree.write(NS, [page(i) for i in range(1, 7)], at=T0)  # 6000 bytes
        ns_cap = policy(namespace_max_bytes=10_000, high_watermark=0.5, low_watermark=0.1)
        (step,) = tree.plan(ns_cap, now=T0 + 100).steps
        # 5 pages go (down to 1000 bytes); the limit holds at 5000: 4000 of them may stay.
        assert (len(step.names), step.bytes, step.room) == (5, 5000, 4000)
    finally:
        tree.store.close()


def roomy(pages: int) -> GcPolicy:
    """A cap that `pages` pages of 1000 bytes are over and that frees nearly all of them (its
    low watermark), with room for most of them under its high watermark: what requests reach
    while GC deletes may stay (the limit does not need it)."""
    return policy(max_bytes=2000 * pages, high_watermark=0.45, low_watermark=0.01)


def test_a_chain_a_request_reads_while_gc_deletes_stays_from_the_next_chunk_on(
    tmp_path: Path,
) -> None:
    tree = Tree.at(tmp_path / "root")
    watcher = Watcher(tree.layout)
    try:
        tree.write(NS, [page(i) for i in range(1, 7)], at=T0)  # one chain: 1 <- 2 <- ... <- 6
        model = ChainModel.from_index(tree.store.conn, [NS])
        plan = tree.plan(roomy(6), now=T0 + 100, model=model)
        assert evicted(plan) == [page(i) for i in range(6, 0, -1)]  # tail first, all of it
        watcher.start()
        assert watcher.watch(NS)
        flight = Flight(watcher, model)()  # taken when GC plans
        # After the plan a request looks the chain up (a stat: no event) and reads it head to
        # tail; GC has not deleted a chunk yet. Page 3 was read: it and its prefix stay.
        with open(tree.layout.ns_dir(NS) / page(3), "rb") as f:
            f.read()
        wait_for(lambda: watcher.accessed, bool)
        execute_gc(plan, tree.run(clock=lambda: T0 + 100), spare=flight.spare)
    finally:
        watcher.stop()
        tree.store.close()
    assert tree.files(NS) == {page(1), page(2), page(3)}


@contextlib.contextmanager
def _two_chains_planned(tmp_path: Path) -> Iterator[tuple[Tree, Watcher, GcPlan, InFlight]]:
    """Chains 1 <- ... <- 6 and 11 <- ... <- 16, a plan that evicts both whole, the watcher
    on, and what GC takes to be in flight as it plans."""
    tree = Tree.at(tmp_path / "root")
    watcher = Watcher(tree.layout)
    try:
        tree.write(NS, [page(i) for i in range(1, 7)], at=T0)
        tree.write(NS, [page(i) for i in range(11, 17)], at=T0 + 1)
        model = ChainModel.from_index(tree.store.conn, [NS])
        plan = tree.plan(roomy(12), now=T0 + 100, model=model)
        assert len(evicted(plan)) == 12
        watcher.start()
        assert watcher.watch(NS)
        yield tree, watcher, plan, Flight(watcher, model)()
    finally:
        watcher.stop()
        tree.store.close()


def _read(tree: Tree, n: int) -> None:
    with open(tree.layout.ns_dir(NS) / page(n), "rb") as f:
        f.read()


def test_only_each_streams_last_page_read_since_the_plan_is_kept(tmp_path: Path) -> None:
    """Not every page read since the plan holds its chain (at full speed that was every
    chain, and the cap was lost: run F): a request that read a chain and then another
    request on the same stream is done with it."""
    with _two_chains_planned(tmp_path) as (tree, watcher, plan, flight):
        for n in (3, 13):  # one request read up to 3, the next one up to 13
            _read(tree, n)
        wait_for(lambda: watcher.accessed, lambda n: n >= 2)
        execute_gc(plan, tree.run(clock=lambda: T0 + 100), spare=flight.spare)
    assert tree.files(NS) == {page(11), page(12), page(13)}


def test_each_fleet_nodes_last_page_read_since_the_plan_is_kept(tmp_path: Path) -> None:
    """A fleet's leader hears another node's reads in its summaries (cachemgr.daemon.fleet.feed)
    beside its own: each node is its own stream, so each one's request in flight keeps its
    chain, as two requests on one stream would not (the test above)."""
    with _two_chains_planned(tmp_path) as (tree, watcher, plan, flight):
        _read(tree, 3)  # this node's request
        wait_for(lambda: watcher.accessed, lambda n: n >= 1)
        watcher.emit((Kind.READ, NS, page(13), watcher.clock(), "gpu-2"))  # another node's
        execute_gc(plan, tree.run(clock=lambda: T0 + 100), spare=flight.spare)
    assert tree.files(NS) == {page(i) for i in (1, 2, 3, 11, 12, 13)}


def test_a_chain_read_while_gc_deletes_stays_whole_before_its_links_are_learned(
    tmp_path: Path,
) -> None:
    """A chain written under load has no links yet (its stores were more than BURST_GAP apart)
    until a read of it is applied. A request reading it while GC deletes was seen at page 2
    before one chunk and at page 5 before the next: sparing only the lineage of a stream's last
    page kept 1, 2 and 5 and let 3 and 4 go, so 5 stayed unusable behind the hole."""
    tree = Tree.at(tmp_path / "root")
    try:
        for i in range(1, 7):  # one request's stores, a second apart: no link learned
            tree.write(NS, [page(i)], at=T0 + i)
        model = ChainModel.from_index(tree.store.conn, [NS])
        assert all(p.pred is None for p in model.pages.values())
        watcher = Watcher(tree.layout)  # not started: its accesses are emitted below
        spare = Flight(watcher, model)().spare
        assert spare is not None
        names = [page(i) for i in (6, 5, 4, 3, 2, 1)]
        kept: set[str] = set()
        for reads in ((1, 2), (3, 4, 5)):  # the request, seen before one chunk, then the next
            for n in reads:
                watcher.emit((Kind.READ, NS, page(n), 0.0, LOCAL))
            kept |= set(spare(NS, names, 0))
        assert kept == {page(i) for i in range(1, 6)}
    finally:
        tree.store.close()


def test_a_streams_run_ends_where_its_next_request_begins(tmp_path: Path) -> None:
    """A request reads its prefix and stores what continues it: its pages stay while GC
    deletes. The stream's next read begins the next request, whose pages alone stay; of what
    a stream stores, the page stored last keeps its chain (a write-only stream's run never
    ends: all it stored kept every chain it wrote)."""
    tree = Tree.at(tmp_path / "root")
    try:
        tree.write(NS, [page(i) for i in range(1, 7)], at=T0)  # 1 <- 2 <- ... <- 6
        tree.write(NS, [page(i) for i in range(11, 17)], at=T0 + 10)  # 11 <- ... <- 16
        tree.write(NS, [page(21)], at=T0 + 20)
        model = ChainModel.from_index(tree.store.conn, [NS])
        watcher = Watcher(tree.layout)  # not started: its accesses are emitted below
        spare = Flight(watcher, model)().spare
        assert spare is not None
        names = [page(i) for i in (*range(1, 7), *range(11, 17), 21)]

        def then(kind: Kind, *pages: int) -> set[str]:
            for n in pages:
                watcher.emit((kind, NS, page(n), 0.0, LOCAL))
            return set(spare(NS, names, 0))

        assert then(Kind.READ, 1, 2, 3) | then(Kind.WRITE, 4) == {page(i) for i in range(1, 5)}
        assert then(Kind.READ, 11) == {page(11)}  # a read after a store: the next request
        assert then(Kind.READ, 12, 11) == {page(11)}  # a page read again
        assert then(Kind.READ, 2) == {page(1), page(2)}  # 1, its predecessor, was not read
        assert then(Kind.WRITE, 21, 14) == {page(i) for i in (1, 2, 11, 12, 13, 14)}
    finally:
        tree.store.close()


class _Reading(LiveState):
    """A daemon whose request reads pages 1 to 5 head to tail just after GC planned, as it
    deletes its first chunk."""

    def __init__(self, watcher: Watcher, model: ChainModel) -> None:
        super().__init__(model=model)
        self.watcher = watcher

    def in_flight(self) -> InFlight:
        assert self.model is not None
        flight = Flight(self.watcher, self.model)()
        spare = flight.spare
        assert spare is not None

        def reached(ns: str, names: Sequence[str], start: int) -> Collection[str]:
            if start == 0:
                for n in range(1, 6):
                    self.watcher.emit((Kind.READ, NS, page(n), 0.0, LOCAL))
            return spare(ns, names, start)

        return flight._replace(spare=reached)


def test_pages_reached_while_gc_deletes_yield_to_the_cap_tails_first(tmp_path: Path) -> None:
    """The plan frees the whole chain (down to the low watermark); a request reaches 1 to 5 as
    GC deletes. The high watermark has room for two and a half pages: the cap takes 5, 4 and 3
    back, tails first (1 <- 2 stays, a usable prefix), and counts them as a protection it
    overrode (cachemgr_gc_protection_overridden_total)."""
    tree = Tree.at(tmp_path / "root")
    tree.write(NS, [page(i) for i in range(1, 7)], at=T0)  # one chain: 1 <- 2 <- ... <- 6
    model = ChainModel.from_index(tree.store.conn, [NS])
    cap = policy(max_bytes=10_000, high_watermark=0.25, low_watermark=0.001)
    live = _Reading(Watcher(tree.layout), model)  # (not started: the reads are emitted)
    runner = GcRunner(tree.layout, tree.store, cap, live=live, disk_usage=big_disk)
    try:
        report = runner.tick()
        assert report is not None
        assert tree.files(NS) == {page(1), page(2)}
        assert runner.stats.overridden == 3
        (step,) = GcResponse.of(report).steps  # POST /v1/gc and `cachemgr gc --json` say so
        assert step.overridden == 3
    finally:
        runner.leadership.release()
        tree.store.close()


class _CountingFormat:
    """The default format, counting the names whose key is parsed."""

    def __init__(self) -> None:
        self.parsed = 0

    def key_len(self, name: str) -> int | None:
        self.parsed += 1
        return DEFAULT_FORMAT.key_len(name)


def test_each_access_since_the_plan_is_parsed_once_not_once_per_chunk(tmp_path: Path) -> None:
    """At full speed tens of thousands of accesses come during a run: parsing all of them
    again before each chunk of 256 was most of a run's time, and the writer outran GC
    (bench/RESULTS.md, the replay's cap check). The chain read last is still kept."""
    tree = Tree.at(tmp_path / "root")
    try:
        tree.write(NS, [page(i) for i in range(1, 7)], at=T0)  # 1 <- 2 <- ... <- 6
        fmt = _CountingFormat()
        model = ChainModel.from_index(tree.store.conn, [NS])
        model.formats = lambda ns: fmt  # type: ignore[assignment,return-value]
        watcher = Watcher(tree.layout)  # not started: its accesses are emitted below
        spare = Flight(watcher, model)().spare
        assert spare is not None
        names = [page(i) for i in range(6, 0, -1)]
        for chunk in range(20):
            for i in range(500):  # another stream's reads, then this one's read of page 3
                watcher.emit((Kind.READ, NS, page(1000 + chunk * 500 + i, "other"), 0.0, LOCAL))
            watcher.emit((Kind.READ, NS, page(3), 0.0, LOCAL))
            fmt.parsed = 0
            assert set(spare(NS, names, 0)) == {page(1), page(2), page(3)}
            assert fmt.parsed <= 501 + 64 + len(names)  # the new ones (and a few older)
        fmt.parsed = 0
        for _ in range(20):  # a hot prefix read again and again: each name parsed once
            for i in range(500):
                watcher.emit((Kind.READ, NS, page(5000 + i), 0.0, LOCAL))
            spare(NS, names, 0)
        assert fmt.parsed <= 500 + 64
    finally:
        tree.store.close()


def _small_cap(tmp_path: Path, **settings: Any) -> tuple[Path, Settings]:
    """A namespace dir under a 4,096-byte cap that only writes wake GC for (an hour's
    interval), unpaced, and the daemon's settings with these besides."""
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    d = register_namespace(layout, NS_A, instance="gpu0")
    cfg = load_settings(
        root=layout.root, gc_interval=3600, gc_max_bytes=4096, gc_delete_rate=None, **settings
    )
    return d, cfg


def test_a_limit_still_crossed_after_a_stuck_run_is_tried_again_without_a_wake(
    tmp_path: Path,
) -> None:
    """Every page too young to go (min_age): the run frees nothing and GC pauses. The writer
    has stopped, so nothing wakes GC again; once the pages are old enough, the retry after the
    pause frees them, not the next interval an hour later."""
    d, cfg = _small_cap(tmp_path, batch_interval=0.05, gc_min_age=1.0)
    with running_daemon(cfg):
        for i in range(8):
            store_page(d, page_name(i))
        wait_for(lambda: page_bytes(d), lambda b: b <= 4096, timeout=30, what="the retry")


def test_stores_wake_gc_before_the_index_has_measured_a_page(tmp_path: Path) -> None:
    """The backlog counts stores at the largest page the index has applied: none before the
    index's first batch, so a writer at full speed filled a small cap many times over (the
    replay: the first wake came with 4,074 stores, 8 MB, pending). The first store's size
    stands for them until then: here the index applies nothing for 10 s, and GC holds
    the cap on the watcher's count alone."""
    d, cfg = _small_cap(tmp_path, batch_interval=10, gc_min_age=0)
    with running_daemon(cfg):
        for i in range(12):
            store_page(d, page_name(i))
            time.sleep(0.1)  # (older than backlog.SETTLE when the wake comes)
        wait_for(lambda: page_bytes(d), lambda b: b <= 4096, timeout=5, what="GC's wake")


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


def test_a_cap_takes_stores_the_index_has_not_applied_once_no_indexed_page_is_left(
    tmp_path: Path,
) -> None:
    """At full speed the index lags the writer by many times a small cap: GC evicted every
    indexed page, logged 'no other page is indexed' and the cap was lost (bench/RESULTS.md,
    the replay's cap check). The stores the watcher queued go too, newest first (a request
    writes its chain head to tail: what is left of a burst is a usable prefix), after the
    indexed pages; one that is not a regular file is never taken; a dry run plans the same."""
    tree = Tree.at(tmp_path / "root")
    try:
        tree.write(NS, [page(i) for i in range(1, 4)], at=T0)  # indexed: 3,000 bytes
        d = tree.dir(NS)
        for i in range(11, 17):  # stored, not applied yet: 6,000 bytes
            (d / page(i)).write_bytes(b"\0" * PAGE)
        os.symlink(d / page(1), d / page(10))  # a queued "store" that is a link: never taken
        unapplied = [(NS, page(i)) for i in (*range(16, 10, -1), 10)]  # in the order to take
        model = ChainModel.from_index(tree.store.conn, [NS])
        live = Live(model, pending=6000, unapplied=unapplied)
        pol = policy(max_bytes=5000, low_watermark=0.9)  # 9,000 on disk: 4,500 must go
        plans = [
            plan_gc(tree.layout, tree.store, pol, now=T0 + 100, disk_usage=big_disk, live=live)
            for _ in range(2)
        ]
        assert evicted(plans[0]) == evicted(plans[1])
        assert sorted(evicted(plans[0])[:3]) == [page(i) for i in range(1, 4)]
        assert evicted(plans[0])[3:] == [page(16), page(15)]  # the newest stores, 1,500 bytes
        assert not any("no other page" in w for w in plans[0].warnings)
        dry = tree.execute(plans[0], now=T0 + 100, dry_run=True)
        real = tree.execute(plans[1], now=T0 + 100)
    finally:
        tree.store.close()
    assert (dry.files, dry.bytes) == (real.files, real.bytes) == (5, 5000)
    assert tree.files(NS) == {page(i) for i in (10, *range(11, 15))}
    assert os.path.islink(d / page(10)) and os.path.exists(d / page(1)) is False


def test_unapplied_stores_are_counted_at_the_backlog_size_and_checked_at_deletion(
    tmp_path: Path,
) -> None:
    """The daemon's plan takes unapplied stores by the size the backlog counts them at, with
    no stat each: a link among them is planned, then refused at deletion as any page file
    that is not a regular file (never followed, never deleted), in the dry run as in the real
    one; the cap is reported not held."""
    tree = Tree.at(tmp_path / "root")
    try:
        tree.write(NS, [page(i) for i in range(1, 4)], at=T0)  # indexed: 3,000 bytes
        d = tree.dir(NS)
        for i in range(11, 17):  # stored, not applied yet: 6,000 bytes
            (d / page(i)).write_bytes(b"\0" * PAGE)
        os.symlink(d / page(1), d / page(10))  # the newest queued "store" is a link
        unapplied = [(NS, page(i)) for i in (10, *range(16, 10, -1))]  # in the order to take
        model = ChainModel.from_index(tree.store.conn, [NS])
        live = Live(model, pending=6000, unapplied=unapplied, store_bytes=PAGE)
        pol = policy(max_bytes=5000, low_watermark=0.9)  # 9,000 on disk: 4,500 must go
        plans = [
            plan_gc(tree.layout, tree.store, pol, now=T0 + 100, disk_usage=big_disk, live=live)
            for _ in range(2)
        ]
        assert evicted(plans[0]) == evicted(plans[1])
        assert evicted(plans[0])[3:] == [page(10), page(16)]  # in that order, by count
        dry = tree.execute(plans[0], now=T0 + 100, dry_run=True)
        real = tree.execute(plans[1], now=T0 + 100)
    finally:
        tree.store.close()
    assert (dry.files, dry.bytes) == (real.files, real.bytes) == (4, 4000)
    assert dry.refused_files() == real.refused_files()
    assert real.refused_files()["not_regular"] == 1
    assert not real.held
    assert tree.files(NS) == {page(i) for i in (10, *range(11, 16))}
    assert os.path.islink(d / page(10))


def test_stores_gc_deleted_before_the_index_applied_them_are_not_pending() -> None:
    """Else the next run counted them on disk still and evicted as much again; and once the
    index applied them they are not taken off twice, whenever GC noted them (a set the index
    pruned raced it: one noted just after the index applied it hid a store still on disk).
    A store seen just now is told apart: its request may still be writing its burst."""
    now = [100.0]
    backlog = StoreBacklog(clock=lambda: now[0])
    for i in range(10):
        backlog.stored(NS, page(i))
    backlog.done(0, PAGE)
    assert backlog.bytes() == 10 * PAGE
    stores = [(NS, page(i)) for i in range(10)]
    assert backlog.unapplied() == (stores, set(stores))  # in the order stored; all seen just now
    now[0] += SETTLE
    assert backlog.unapplied() == (stores, set())
    backlog.done(2, PAGE)  # the index applies two (GC deleted them meanwhile) ...
    backlog.gone_early([(NS, page(i)) for i in range(4)])  # ... and GC notes 4 deleted after
    assert backlog.bytes() == 6 * PAGE
    assert backlog.unapplied() == (stores[4:], set())
    backlog.done(2, PAGE)  # the index applies the other two
    assert backlog.bytes() == 6 * PAGE and not backlog.early


def test_stores_the_index_took_from_the_queue_but_has_not_committed_are_in_flight(
    tmp_path: Path,
) -> None:
    """The index drains the whole queue, then applies it batch by batch (seconds at full
    speed): what it holds meanwhile is in neither the queue nor the index, and GC must see it."""
    tree = Tree.at(tmp_path / "root")
    try:
        model = ChainModel.from_index(tree.store.conn, [NS])
        watcher = Watcher(tree.layout)  # not started: its events are put below
        watcher.applying = [
            (Kind.WRITE, NS, page(1), 0.0, LOCAL),
            (Kind.WRITE, NS, page(2), 0.0, LOCAL),
        ]
        watcher.queue.extend(
            [(Kind.WRITE, NS, page(2), 0.0, LOCAL), (Kind.WRITE, NS, page(3), 0.0, LOCAL)]
        )
        flight = Flight(watcher, model)()
    finally:
        tree.store.close()
    assert {k for _, k in flight.queued} == {page(i)[:64] for i in (1, 2, 3)}


def test_a_backlog_of_whole_requests_is_taken_request_by_request_tail_first(
    tmp_path: Path,
) -> None:
    """Under load the index lagged a dozen requests behind a small cap: taken newest first
    without the stores seen just now, the oldest request lost its head (settled) while its
    tail (seen with the rest, at once) stayed, unusable. Each request's burst ends where its
    stream reads again: whole bursts go newest first, seen just now or not; each stream's
    last burst may still be growing and goes last, newest first, without what was seen just
    now."""
    tree = Tree.at(tmp_path / "root")
    try:
        watcher = Watcher(tree.layout)  # not started: its events are put below
        rank1 = page(99)[:64] + "_m_1_2.bin"  # another rank's stream, its own run
        events: list[Event] = []
        for burst in ((1, 2, 3), (4, 5), (6, 7)):
            events += [(Kind.READ, NS, page(0), 0.0, LOCAL)]  # the shared prefix, read
            events += [(Kind.WRITE, NS, page(i), 0.0, LOCAL) for i in burst]
        events.insert(3, (Kind.WRITE, NS, rank1, 0.0, LOCAL))  # rank 1 stores amid rank 0's
        watcher.queue.extend(events)
        stored = [(NS, n) for kind, _, n, _, _ in events if kind is Kind.WRITE]
        flight = Flight(watcher, ChainModel.from_index(tree.store.conn, [NS]))
        got = flight(stored, fresh={(NS, page(7))})
    finally:
        tree.store.close()
    assert [n for _, n in got.stored] == [
        *(page(i) for i in (5, 4, 3, 2, 1)),  # whole bursts, newest first
        page(6),  # the last burst, without page 7, seen just now ...
        rank1,  # ... and another stream's, newest first
    ]


def test_stores_a_chunk_deleted_are_pending_no_more_from_that_chunk_on() -> None:
    """Of the stores the index had not applied at the plan, those a chunk recorded gone leave
    the backlog's count as the chunk is recorded, not when the run ends (an unlink error may
    end it first); a name it did not take stays pending."""

    class Early(LiveState):
        def __init__(self) -> None:
            super().__init__()
            self.early: list[tuple[str, str]] = []

        def gone_early(self, pages: Iterable[tuple[str, str]]) -> None:
            self.early.extend(pages)

    live = Early()
    # no model, nothing unapplied: nothing to tell
    assert forgetting(live.model, live.gone_early, []) is None
    recorded = forgetting(live.model, live.gone_early, [(NS, page(1)), (NS, page(2))])
    assert recorded is not None
    recorded(NS, [page(2), page(3)])  # page 3 was indexed: not a pending store
    assert live.early == [(NS, page(2))]


def _files(d: Path) -> int:
    with os.scandir(d) as entries:
        return sum(1 for e in entries if e.name.endswith(".bin"))


def test_a_purge_s_paced_drain_never_holds_a_cap_back(tmp_path: Path) -> None:
    """A run drained .trash/ before its evictions, at delete_rate: 3,000 trash files at 100 a
    second held a 200-page cap back for 30 s (it reached 1,981 pages). The limits go first
    now; the drain keeps its rate and yields to a limit crossed meanwhile."""
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    live = register_namespace(layout, NS_A, instance="gpu0")
    old = register_namespace(layout, NS_B, instance="old")
    for i in range(3000):
        store_page(old, page_name(i, "old"), 4096)
    with Store.open(layout.db_path) as store:  # renamed into .trash/ before the daemon starts
        purge(layout, store, actor="cli", reason="manual", namespace=NS_B)
    (entry,) = os.listdir(layout.trash)
    cap = 200
    settings = load_settings(
        root=layout.root,
        gc_namespace_max_bytes=cap * 4096,
        gc_min_age=0,
        gc_interval=3600,
        gc_delete_rate=100,
    )
    most = 0
    started = time.monotonic()  # (the drain starts with the daemon)
    with running_daemon(settings):
        t0 = time.monotonic()
        for i in range(1000):  # ~6 s at this pace: 5 caps' worth
            store_page(live, page_name(i), 4096)
            if i % 10 == 0:
                most = max(most, _files(live))
            time.sleep(0.005)
        drained, took = 3000 - _files(layout.trash / entry), time.monotonic()
    assert most <= 1.3 * cap, f"{most} pages against a cap of {cap}"
    # Paced all along (a pacer lets its first batch of 256 go at once), and not starved.
    at_most = 100 * (took - started) + Pacer.batch
    assert 0.5 * 100 * (took - t0) <= drained <= at_most, f"{drained} in {took - t0:.1f} s"
