"""The live index against real inotify events: stores, reads, deletions, namespace dirs
appearing and leaving, a real kernel queue overflow, and a restart."""

from __future__ import annotations

import itertools
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachemgr.daemon.events import Kind
from cachemgr.daemon.indexer import Indexer, IndexerConfig, IndexerHooks, IndexerShared
from cachemgr.daemon.watcher import Event, Watcher
from cachemgr.fs.leadership import Leadership
from cachemgr.layout import Layout
from cachemgr.ns.quarantine import STATE_DIR
from cachemgr.state.store import Store, connect
from cachemgr.worker import Worker
from tests.daemon_helpers import NS_A, NS_B, page_name, read_page, store_page
from tests.polling import wait_for


def start(layout: Layout, store: Store, watcher: Watcher | None = None) -> Indexer:
    ix = Indexer(layout, store, IndexerConfig(batch_interval=0.05), IndexerShared(watcher=watcher))
    ix.start()
    assert ix.state.ready.wait(10)
    wait_for(lambda: ix.state.settling, lambda v: not v)  # (GC's model after ready)
    return ix


@pytest.fixture
def reader(layout: Layout, store: Store) -> Iterator[sqlite3.Connection]:
    """A connection of its own: the index thread owns `store`."""
    conn = connect(layout.db_path)
    yield conn
    conn.close()


def ns_stats(conn: sqlite3.Connection, ns: str) -> tuple[int, ...]:
    """(pages, bytes, lifetime reads, lifetime writes) as the DB has them."""
    row = conn.execute(
        "SELECT pages, bytes, page_reads, page_writes FROM namespace_stats WHERE namespace_id = ?",
        (ns,),
    ).fetchone()
    return tuple(row) if row else (0, 0, 0, 0)


def live_counts(ix: Indexer, ns: str) -> tuple[int, int]:
    """(reads, writes) the indexer counted live: they follow its batch's commit."""
    c = ix.state.counters.get(ns)
    return (c.reads, c.writes) if c else (0, 0)


def scanned_at(conn: sqlite3.Connection, ns: str) -> float:
    """When the indexer last scanned the namespace dir (0: never); it watches it before."""
    row = conn.execute(
        "SELECT scanned_at FROM namespace_stats WHERE namespace_id = ?", (ns,)
    ).fetchone()
    return float(row[0] or 0) if row else 0.0


def test_stores_reads_and_deletes_reach_the_index(
    store: Store, layout: Layout, reader: sqlite3.Connection
) -> None:
    d = layout.ns_dir(NS_A)
    d.mkdir()
    store_page(d, page_name(0))
    ix = start(layout, store)
    try:
        for i in range(1, 21):
            store_page(d, page_name(i), 2048)
        for i in range(5):
            read_page(d, page_name(i))
        read_page(d, page_name(1))
        (d / page_name(20)).unlink()
        wait_for(lambda: ns_stats(reader, NS_A), lambda s: s == (20, 1024 + 19 * 2048, 6, 20))
        wait_for(lambda: live_counts(ix, NS_A), lambda c: c == (6, 20), timeout=10)
        reads = dict(reader.execute("SELECT name, reads FROM pages WHERE reads > 0"))
        assert reads == {page_name(0): 1, page_name(1): 2, **{page_name(i): 1 for i in (2, 3, 4)}}
        assert ix.lag() == 0.0
    finally:
        ix.stop()


def test_new_namespace_dirs_are_picked_up_and_moved_ones_forgotten(
    store: Store, layout: Layout, reader: sqlite3.Connection
) -> None:
    ix = start(layout, store)
    try:
        d = layout.ns_dir(NS_B)
        d.mkdir()
        wait_for(lambda: scanned_at(reader, NS_B), bool)  # watched: its stores count as writes
        for i in range(7):
            store_page(d, page_name(i))
        wait_for(lambda: ns_stats(reader, NS_B), lambda s: s == (7, 7 * 1024, 0, 7))
        # A purge renames the dir into .trash/ and recreates it empty; the trash is then
        # deleted, and those deletions must not touch the new namespace dir's index.
        before = scanned_at(reader, NS_B)
        os.rename(d, layout.trash / f"{NS_B}.x")
        d.mkdir()
        wait_for(lambda: ns_stats(reader, NS_B)[:2], lambda s: s == (0, 0))
        wait_for(lambda: scanned_at(reader, NS_B), lambda t: t > before)  # the new dir's watch
        store_page(d, page_name(0))
        for f in (layout.trash / f"{NS_B}.x").iterdir():
            f.unlink()
        wait_for(lambda: ns_stats(reader, NS_B)[:2], lambda s: s == (1, 1024))
    finally:
        ix.stop()


class SlowWatcher(Watcher):
    """A watcher whose consumer stalls on the first event, as a busy daemon would."""

    def __init__(self, layout: Layout) -> None:
        super().__init__(layout)
        self.release = threading.Event()

    def emit(self, event: Event) -> None:
        self.release.wait(30)
        super().emit(event)


def test_a_kernel_queue_overflow_is_counted_and_repaired_by_a_rescan(
    store: Store, layout: Layout, reader: sqlite3.Connection
) -> None:
    d = layout.ns_dir(NS_A)
    d.mkdir()
    store_page(d, page_name(0))
    watcher = SlowWatcher(layout)
    ix = start(layout, store, watcher)
    try:
        limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
        store_page(d, page_name(1))  # the inotify thread now blocks in emit()
        # Reads queue one event each (alternating files: the kernel merges identical
        # consecutive events) until the kernel queue overflows.
        # The blocked thread may already hold a buffer of a few hundred events: twice the
        # limit makes the overflow certain, and before the stores below.
        paths = [d / page_name(0), d / page_name(1)]
        for i in range(2 * limit):
            os.close(os.open(paths[i % 2], os.O_RDONLY))
        for i in range(2, 50):  # stores the kernel can no longer report
            store_page(d, page_name(i))
        watcher.release.set()
        wait_for(lambda: ix.state.overflows, lambda n: n >= 1, timeout=30)
        wait_for(lambda: ns_stats(reader, NS_A)[:2], lambda s: s == (50, 50 * 1024), timeout=30)
        # The rescan found the stores the events missed. Its rows are committed before its
        # report is counted (the model is reloaded in between), so wait for the count too.
        wait_for(lambda: ix.state.drift_pages, lambda n: n >= 1, timeout=10)
    finally:
        watcher.release.set()
        ix.stop()


class FailingWatcher(Watcher):
    """A watcher whose callback fails on the first store it sees (a bug in its handling)."""

    def __init__(self, layout: Layout) -> None:
        super().__init__(layout)
        self.failures = 0

    def emit(self, event: Event) -> None:
        if event[0] is Kind.WRITE and not self.failures:
            self.failures += 1
            raise RuntimeError("a bug in an event's handling")
        super().emit(event)


def test_a_callback_that_raises_loses_its_events_to_a_rescan_not_the_inotify_thread(
    store: Store, layout: Layout, reader: sqlite3.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """An exception in an event's handling used to end the inotify thread without a word: no
    store, read or deletion reached the index again until a restart. The events it lost are
    found by a rescan, as after a kernel queue overflow, and it is said."""
    d = layout.ns_dir(NS_A)
    d.mkdir()
    watcher = FailingWatcher(layout)
    ix = start(layout, store, watcher)
    try:
        store_page(d, page_name(0))  # its event is lost to the failure: the rescan finds it
        wait_for(lambda: ix.state.overflows, lambda n: n >= 1, timeout=10)
        for i in range(1, 4):  # the thread still hears the disk
            store_page(d, page_name(i))
        read_page(d, page_name(3))
        wait_for(lambda: ns_stats(reader, NS_A), lambda s: s == (4, 4 * 1024, 1, 3), timeout=10)
        assert watcher._fd is not None and watcher._fd.is_alive()
        said = [r for r in caplog.records if r.msg.startswith("inotify events not handled")]
        assert len(said) == 1 and said[0].exc_info is not None
    finally:
        ix.stop()


def indexed_then_stopped(layout: Layout, store: Store, pages: int) -> Path:
    """NS_A's dir with `pages` pages, indexed by an index writer that then stopped cleanly
    (saving its model file)."""
    d = layout.ns_dir(NS_A)
    d.mkdir()
    for i in range(pages):
        store_page(d, page_name(i))
    start(layout, store).stop()
    return d


def test_a_restart_from_the_model_file_is_ready_before_it_scans(
    store: Store, layout: Layout, reader: sqlite3.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """A scan of every page file costs a cold `du` (155 s at 10M pages) and a sidecar's
    readiness holds its pod out of service: a start whose model file holds the index as it is
    is ready first, watching already, and its first tick scans for what changed while down
    (not drift: no event was missed while it watched)."""
    caplog.set_level(logging.INFO, logger="cachemgr.daemon.indexer")
    d = indexed_then_stopped(layout, store, 30)
    assert layout.model_snapshot.is_file()
    (d / page_name(0)).unlink()  # while the daemon is down
    store_page(d, page_name(30))
    gate = threading.Event()
    marker = layout.state_dir / "index-test.ready"  # (what other processes count by)
    ix = Indexer(
        layout,
        store,
        IndexerConfig(batch_interval=0.05, ready_marker=marker),
        hooks=IndexerHooks(on_applied=lambda: gate.wait(10)),  # the thread waits once ready
    )
    ix.start()
    try:
        assert ix.state.ready.wait(10) and ix.state.settling
        assert not ix.state.settled.is_set()  # (GC's runs wait for it)
        assert "changed while down" in ix.state.pending
        assert not marker.exists()  # a CLI or another daemon does not take the index as live
        names = lambda: {n for (n,) in reader.execute("SELECT name FROM pages")}  # noqa: E731
        assert names() == {page_name(i) for i in range(30)}  # the index as it was at the stop
        store_page(d, page_name(31))  # watched from ready on: no scan needed to find it
        gate.set()
        wait_for(lambda: ix.state.settling, lambda v: not v)
        assert ix.state.settled.is_set() and ix.state.ready.is_set() and marker.exists()
        want = {page_name(i) for i in range(1, 32)}
        wait_for(names, lambda got: got == want)
        assert ix.state.drift_pages == 0
        said = [r.msg for r in caplog.records if r.name == "cachemgr.daemon.indexer"]
        assert said.index("index ready") < said.index("index settled")
    finally:
        ix.stop()


def test_a_start_without_a_usable_model_file_scans_before_it_is_ready(
    store: Store, layout: Layout, reader: sqlite3.Connection
) -> None:
    d = indexed_then_stopped(layout, store, 5)
    reader.execute("DELETE FROM model_stamp")  # another process wrote the index meanwhile
    store_page(d, page_name(5))
    gate = threading.Event()
    hooks = IndexerHooks(on_applied=lambda: gate.wait(10))  # the thread waits once ready
    ix = Indexer(layout, store, IndexerConfig(batch_interval=0.05), hooks=hooks)
    ix.start()
    try:
        assert ix.state.ready.wait(10)
        assert reader.execute("SELECT COUNT(*) FROM pages").fetchone()[0] == 6  # scanned first
        assert "changed while down" not in ix.state.pending
    finally:
        gate.set()
        ix.stop()


def test_restart_rebuilds_the_same_index_without_resetting_recency(
    store: Store, layout: Layout, reader: sqlite3.Connection
) -> None:
    d = layout.ns_dir(NS_A)
    d.mkdir()
    for i in range(30):
        store_page(d, page_name(i))
    ix = start(layout, store)
    read_page(d, page_name(3))
    wait_for(lambda: ns_stats(reader, NS_A)[2], lambda r: r == 1)
    ix.stop()
    before = dict(reader.execute("SELECT name, last_access FROM pages"))
    (d / page_name(0)).unlink()  # while the daemon is down
    store_page(d, page_name(30))
    ix = start(layout, store)
    try:
        after = dict(reader.execute("SELECT name, last_access FROM pages"))
        assert set(after) == set(before) - {page_name(0)} | {page_name(30)}
        assert all(after[n] == before[n] for n in set(after) & set(before))
        assert ns_stats(reader, NS_A) == (30, 30 * 1024, 1, 0)  # lifetime reads survive
    finally:
        ix.stop()


def test_reads_and_stores_get_access_seq_in_the_order_seen(
    store: Store, layout: Layout, reader: sqlite3.Connection
) -> None:
    """One counter over reads and stores, in inotify order, resumed after a restart: within a
    batch (one last_access for all) it is what tells GC a chain's head from its tail."""
    d = layout.ns_dir(NS_A)
    d.mkdir()
    ix = start(layout, store)
    try:
        for i in range(5):
            store_page(d, page_name(i))
        for i in (3, 1):
            read_page(d, page_name(i))
        seqs = wait_for(
            lambda: dict(reader.execute("SELECT name, access_seq FROM pages")),
            lambda s: len(s) == 5 and s[page_name(1)] > s[page_name(4)],
        )
    finally:
        ix.stop()
    order = sorted(seqs, key=seqs.__getitem__)
    assert order == [page_name(i) for i in (0, 2, 4, 3, 1)]
    ix = start(layout, store)  # a restart resumes after the largest stored value
    try:
        read_page(d, page_name(0))
        wait_for(
            lambda: reader.execute(
                "SELECT access_seq FROM pages WHERE name = ?", (page_name(0),)
            ).fetchone()[0],
            lambda seq: seq > seqs[page_name(1)],
        )
    finally:
        ix.stop()


class GatedLeadership(Leadership):
    """Leadership the test lets a follower take only once `gate` is set."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.gate = threading.Event()

    def try_acquire(self) -> bool:
        return self.gate.is_set() and super().try_acquire()


def test_a_second_daemon_follows_and_takes_over_when_the_first_stops(
    store: Store, layout: Layout, reader: sqlite3.Connection
) -> None:
    """Two daemons on one root: one indexes, so nothing is counted twice; the other is ready
    only while the leader's index is, takes over when it stops and catches up on the gap."""
    d = layout.ns_dir(NS_A)
    d.mkdir()
    lock, marker = layout.state_dir / "index.lock", layout.state_dir / "index.ready"
    first = Indexer(
        layout,
        store,
        IndexerConfig(batch_interval=0.05, leadership=Leadership(lock), ready_marker=marker),
    )
    second_store = Store.open(layout.db_path)
    gated = GatedLeadership(lock)
    second = Indexer(
        layout,
        second_store,
        IndexerConfig(batch_interval=0.05, leadership=gated, ready_marker=marker),
    )
    first.start()
    assert first.state.ready.wait(10) and first.state.leader and marker.exists()
    second.start()
    try:
        assert second.state.ready.wait(10) and not second.state.leader  # ready as a follower
        for i in range(10):
            store_page(d, page_name(i))
        read_page(d, page_name(0))
        wait_for(lambda: ns_stats(reader, NS_A), lambda s: s == (10, 10 * 1024, 1, 10))
        assert NS_A not in second.state.counters  # the follower counted nothing
        first.stop()
        assert not marker.exists()
        wait_for(lambda: second.state.ready.is_set(), lambda r: not r)  # nobody indexes
        for i in range(10, 15):  # nobody watches these
            store_page(d, page_name(i))
        gated.gate.set()
        wait_for(lambda: second.state.ready.is_set() and second.state.leader, bool)
        assert second.state.drift_pages == 5  # the takeover rescan found the gap's pages
        store_page(d, page_name(15))
        wait_for(lambda: ns_stats(reader, NS_A)[:2], lambda s: s == (16, 16 * 1024))
        wait_for(lambda: live_counts(second, NS_A)[1], lambda n: n == 1)  # it watches now
    finally:
        first.stop()
        second.stop()
        second_store.close()
    assert ns_stats(reader, NS_A)[2] == 1  # one read, counted once
    assert not marker.exists()


def test_a_failed_index_writer_lets_another_daemon_take_over(store: Store, layout: Layout) -> None:
    lock = layout.state_dir / "index.lock"
    died: list[Worker] = []
    ix = Indexer(
        layout,
        store,
        IndexerConfig(batch_interval=0.05, leadership=Leadership(lock)),
        on_death=died.append,
    )
    store.close()  # the writer's first scan fails on a closed DB
    ix.start()
    wait_for(lambda: died, bool)
    assert died == [ix] and not ix.up and ix.error is not None
    assert not ix.state.ready.is_set()
    ix.stop()
    other = Leadership(lock)
    assert other.try_acquire()  # released on the way out, not held by a dead thread
    other.release()


def test_a_follower_taking_over_is_not_ready_until_its_own_rescan_ends(
    store: Store, layout: Layout
) -> None:
    layout.ns_dir(NS_A).mkdir()
    lock, marker = layout.state_dir / "index.lock", layout.state_dir / "index.ready"
    first = Indexer(
        layout,
        store,
        IndexerConfig(batch_interval=0.05, leadership=Leadership(lock), ready_marker=marker),
    )
    first.start()
    assert first.state.ready.wait(10)
    second_store = Store.open(layout.db_path)
    second = Indexer(
        layout,
        second_store,
        IndexerConfig(batch_interval=0.05, leadership=Leadership(lock), ready_marker=marker),
    )
    scanning, release = threading.Event(), threading.Event()
    scan_all = second._scan_all

    def slow_scan_all(*, first: bool) -> None:
        scanning.set()
        release.wait(10)
        scan_all(first=first)

    second._scan_all = slow_scan_all  # type: ignore[method-assign]
    second.start()
    try:
        assert second.state.ready.wait(10) and not second.state.leader
        first.stop()  # a graceful handover: marker gone and lock free within one follow tick
        assert scanning.wait(10) and second.state.leader
        assert not second.state.ready.is_set() and not marker.exists()
        release.set()
        assert second.state.ready.wait(10) and marker.exists()
    finally:
        release.set()
        first.stop()
        second.stop()
        second_store.close()


def test_names_that_are_not_pages_never_reach_the_index(
    store: Store, layout: Layout, reader: sqlite3.Connection
) -> None:
    d = layout.ns_dir(NS_A)
    d.mkdir()
    ix = start(layout, store)
    try:
        odd = os.path.join(os.fsencode(d), b"%064x" % 7 + b"_m\xff_0_1.bin")  # not UTF-8
        for name in (odd, os.path.join(os.fsencode(d), b"notes.bin")):
            tmp = os.path.join(os.fsencode(d), b".x.tmp")
            with open(tmp, "wb") as f:
                f.write(b"x")
            os.replace(tmp, name)  # stored like a page, read, deleted
            with open(name, "rb") as f:
                f.read()
            os.unlink(name)
        store_page(d, page_name(1))
        wait_for(lambda: ns_stats(reader, NS_A), lambda s: s == (1, 1024, 0, 1))
        # The in-memory counters are bumped just after the batch commits: wait for them too.
        counted = wait_for(
            lambda: ix.state.counters.get(NS_A), lambda c: c is not None and c.writes
        )
        assert ix.error is None and counted.writes == 1
    finally:
        ix.stop()


def test_a_build_the_full_disk_refuses_is_retried_with_backoff_and_said(
    store: Store, layout: Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state dir whose filesystem stays full (one apart from the root's waits for a person)
    rescanned every namespace every second for as long; each refusal now doubles the wait, the
    state dir is held aside as full meanwhile (/readyz, the metric), and freed when it works."""
    full = threading.Event()
    full.set()
    builds: list[float] = []
    ix = Indexer(layout, store, IndexerConfig(batch_interval=0.05))
    scan_all = ix._scan_all

    def scanned(*, first: bool) -> None:
        builds.append(time.monotonic())
        if full.is_set():
            raise sqlite3.OperationalError("database or disk is full")
        scan_all(first=first)

    monkeypatch.setattr(ix, "_scan_all", scanned)
    ix.start()
    try:
        wait_for(lambda: len(builds), lambda n: n >= 3, timeout=10, what="three builds")
        assert ix.quarantine.holds(STATE_DIR, "full")
        assert not ix.state.ready.is_set()
        gaps = [b - a for a, b in itertools.pairwise(builds)]
        assert gaps[0] >= 0.95 and gaps[1] >= 1.95, gaps  # 1 s, then 2 s (was: 1 s each)
        full.clear()
        assert ix.state.ready.wait(10)
        assert not ix.quarantine.holds(STATE_DIR, "full")
    finally:
        ix.stop()
