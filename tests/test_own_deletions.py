"""GC's own deletions are not queued for the index (cachemgr.daemon.owndeletes): a real watcher
on a real dir, GC's real execution, and another process's deletion beside them."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import pytest
from watchdog.observers.inotify_c import InotifyFD

from cachemgr.daemon.events import Kind
from cachemgr.daemon.owndeletes import MOST, STALE, OwnDeletions
from cachemgr.daemon.page_events import PageEvents
from cachemgr.daemon.watcher import C, Watcher, _Reader
from cachemgr.errors import ConfigError
from cachemgr.formats import DEFAULT_FORMAT
from cachemgr.fs.root import create_root
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.execute import CHUNK, InFlight, execute_gc
from cachemgr.gc.plan import GcPlan
from cachemgr.gc.runner import GcRunner, LiveState
from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from cachemgr.state.store import Store
from tests.daemon_helpers import NS_A, page_name, register_namespace, running_daemon, store_page
from tests.gc_helpers import NS, NS2, T0, Tree, big_disk, evicted, page, policy
from tests.polling import wait_for
from tests.vllmtrees import block_path, key, vllm_store, vllm_tree


def _gone(watcher: Watcher) -> set[str]:
    return {name for kind, ns, name, *_ in list(watcher.queue) if kind is Kind.GONE}


def test_a_cap_run_deletes_without_queueing_its_deletions_and_others_still_are(
    tmp_path: Path,
) -> None:
    """Ten pages, a cap that takes some: their IN_DELETE never reaches the queue; a page
    someone else deletes before the run does; a page the run refused (immutable: the kernel's
    EPERM) and that someone deletes later is news again; nothing stays expected."""
    tree = Tree.at(tmp_path / "root")
    watcher = Watcher(tree.layout)
    d = tree.dir(NS)
    try:
        plan = _watched_cap_plan(tree, watcher)
        planned = evicted(plan)
        kept, other = planned[0], next(n for n in tree.files(NS) if n not in planned)
        assert len(planned) >= 4
        _pinned(d / kept, True)
        (d / other).unlink()  # someone else, before the run
        deleted: set[str] = set()
        execute_gc(plan, tree.run(), unlinking=watcher.own, recorded=lambda _, n: deleted.update(n))
        assert deleted == set(planned) - {kept}  # refused
        _pinned(d / kept, False)
        (d / kept).unlink()  # someone else, after the run: news again
        wait_for(lambda: _gone(watcher), lambda g: kept in g, what="the late deletion")
        time.sleep(0.2)  # (any IN_DELETE of the run's unlinks is read by now)
        assert _gone(watcher) == {other, kept}
        assert len(watcher.own) == 0
    finally:
        watcher.stop()
        tree.store.close()
        for name in os.listdir(d):
            _pinned(d / name, False)
    assert not deleted & tree.files(NS)


def _pinned(path: Path, on: bool) -> None:
    """chattr +i (on) or -i: the kernel refuses its unlink (EPERM), even to root."""
    subprocess.run(["chattr", "+i" if on else "-i", str(path)], check=True)


def _watched(tree: Tree, watcher: Watcher, names: list[str]) -> None:
    """These pages of NS written, and the watcher started on NS."""
    tree.write(NS, names, at=T0)
    watcher.start()
    assert watcher.watch(NS)


def _watched_cap_plan(tree: Tree, watcher: Watcher) -> GcPlan:
    """Ten pages of NS, watched, and the plan of a cap (min_age 60 s) that takes some."""
    _watched(tree, watcher, [page(i) for i in range(1, 11)])
    model = ChainModel.from_index(tree.store.conn, [NS])
    return tree.plan(policy(max_bytes=6000, min_age=60), now=time.time(), model=model)


def test_what_is_expected_stays_bounded_and_goes_with_lost_events() -> None:
    own = OwnDeletions()
    own.expect(NS, ["a", "b", "c"])
    own.settle(NS, ["a", "b", "c"], {"a", "b"})  # c refused: not GC's after all
    assert not own.take(NS, "c") and own.take(NS, "a") and not own.take(NS, "a")
    own.forget(NS)  # the namespace was purged: b's event will not come
    assert len(own) == 0
    own.expect(NS, [str(i) for i in range(MOST - 1)])
    own.expect(NS, ["x", "y"])  # past MOST: the older names' events were lost
    assert len(own) == 2 and own.take(NS, "y")
    own.clear()
    assert not own.take(NS, "x")


def test_a_run_an_unlink_error_ends_leaves_no_deleted_page_in_the_model(tmp_path: Path) -> None:
    """A cap run whose unlink fails of something else than a refusal (here EBUSY: a page a
    bind mount covers; on a bad day EIO, or EROFS once ext4 remounts read-only) ends in an
    error after some pages went: their rows left the index with the chunk, their IN_DELETE
    were dropped as GC's own, so only the run can make the model forget them. A reconcile
    finds the index right (no drift) and does not reload the model either."""
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    d = register_namespace(layout, NS_A, instance="gpu0")
    names = [page_name(i) for i in range(12)]
    for i, name in enumerate(names):
        store_page(d, name, 1024, mtime=T0 + i)
    busy = d / names[6]  # in the middle of what the cap takes
    (tmp_path / "cover").write_bytes(b"\x01" * 1024)
    os.utime(tmp_path / "cover", (T0 + 6, T0 + 6))  # (what the bind mount shows)
    subprocess.run(["mount", "--bind", str(tmp_path / "cover"), str(busy)], check=True)
    cfg = load_settings(
        root=layout.root,
        gc_max_bytes=2048,
        gc_high_watermark=1.0,
        gc_low_watermark=0.5,
        gc_min_age=0,
        gc_delete_rate=None,
        gc_interval=3600,
        reconcile_interval=1,
    )
    try:
        with running_daemon(cfg) as dm:
            wait_for(lambda: _left(d, names), lambda left: len(left) < 12, what="a run")
            time.sleep(2.5)  # a reconcile or two
            model = dm.daemon.indexer.model
            key_len = model.formats(NS_A).key_len
            left = _left(d, names)
            ghosts = [n for n in names if n not in left and model.names(NS_A, n[: key_len(n)])]
            assert not ghosts, f"{len(ghosts)} pages deleted and still in the model"
            assert busy.name in left  # (the cap took it: its unlink failed)
    finally:
        subprocess.run(["umount", "-l", str(busy)], check=False)


def _left(d: Path, names: list[str]) -> set[str]:
    return {n for n in names if os.path.lexists(d / n)}


def test_a_page_stored_again_during_the_run_that_deleted_it_stays_in_the_model(
    tmp_path: Path,
) -> None:
    """GC deleted a page, the engine stored it again (a request recomputed the prefix) and the
    index applied that store before GC recorded the chunk (its batch came between the unlinks
    and the record): the record keeps its row and its page in the model, which describe a file
    on disk. Dropped, the page stayed out of the index and of the cap's order until a
    reconcile."""
    tree = Tree.at(tmp_path / "root")
    n = CHUNK + 600
    tree.write(NS, [page(i) for i in range(1, n + 1)], at=T0)
    watcher = Watcher(tree.layout)
    model = ChainModel.from_index(tree.store.conn, [NS])
    pages = PageEvents(tree.layout, tree.store, model=model)
    plan = tree.plan(policy(max_bytes=100_000, low_watermark=0.1), now=time.time(), model=model)
    again = evicted(plan)[0]

    def engine_and_index(files: int, size: int) -> None:
        """After the first part's unlinks: the store, read by the watcher, applied."""
        if files and not (tree.dir(NS) / again).exists() and not watcher.queue:
            store_page(tree.dir(NS), again, 1000)
            wait_for(lambda: len(watcher.queue), bool, what="the store's event")
            batch = [watcher.queue.popleft()]
            assert [(k, n) for k, _, n, *_ in batch] == [(Kind.WRITE, again)]
            pages.apply(batch, now=time.time())

    def forgets(ns: str, names: list[str]) -> None:
        model.forget_gone(ns, names, DEFAULT_FORMAT)

    try:
        watcher.start()
        assert watcher.watch(NS)
        execute_gc(
            plan, tree.run(), progress=engine_and_index, unlinking=watcher.own, recorded=forgets
        )
        assert again in tree.files(NS)
        assert len(tree.files(NS)) < n - CHUNK  # the run went on past its first chunk
        rows = {n for (n,) in tree.store.conn.execute("SELECT name FROM pages")}
        assert rows == tree.files(NS)
        assert model.names(NS, again[: DEFAULT_FORMAT.key_len(again)]) == (again,)
    finally:
        watcher.stop()
        tree.store.close()


def test_a_store_counts_as_again_only_after_gcs_deletion_of_it_was_taken() -> None:
    """`again` names the pages stored after the watcher took GC's deletion of them and before
    GC records them; not one stored before its unlink (GC deleted that very file), nor one
    whose record let it go already, nor one an earlier run left behind."""
    own = OwnDeletions()
    own.expect(NS, ["a", "b", "c", "d"])
    own.stored(NS, "a")  # (a store read before the deletion: GC unlinked that file)
    assert own.take(NS, "a") and own.take(NS, "b") and own.take(NS, "c")
    own.stored(NS, "b")
    own.stored(NS2, "c")  # (another namespace's page of that name)
    assert own.again(NS, ["a", "b", "c"]) == {"b"}
    own.stored(NS, "b")  # (after the record: the index applies it, as any store)
    assert own.again(NS, ["b"]) == set()
    assert own.take(NS, "d")  # a deletion no record let go of (its run ended in an error)
    own.stored(NS, "d")
    own.expect(NS, ["d"])  # the next run deletes it again
    assert own.again(NS, ["d"]) == set()


class _Applying(LiveState):
    """A daemon whose index is applying a batch of stores as GC plans: GC counts them, and a
    cap takes them once nothing the index knows of is left."""

    def __init__(self, watcher: Watcher, model: ChainModel, stored: list[str]) -> None:
        super().__init__(model=model)
        self.watcher, self.stored = watcher, [(NS, n) for n in stored]

    def pending(self) -> int:
        return 1000 * len(self.stored)

    def in_flight(self) -> InFlight:
        return InFlight(stored=self.stored, stored_bytes=1000)

    def unlinking(self) -> OwnDeletions:
        return self.watcher.own


def test_a_store_gc_deletes_while_the_index_applies_it_leaves_no_row(tmp_path: Path) -> None:
    """The index stat'ed a batch's stores (on disk), then GC deleted them before the batch
    wrote their rows: the rows and the model's pages describe files that are gone. Only the
    IN_DELETE queued behind the stores drops them again; dropped as GC's own, they stayed (and
    counted against the cap) until the next reconcile."""
    tree = Tree.at(tmp_path / "root")
    d = tree.dir(NS)
    watcher = Watcher(tree.layout)
    model = ChainModel(lambda ns: DEFAULT_FORMAT)
    pages = PageEvents(tree.layout, tree.store, model=model)
    names = [page(i) for i in range(1, 7)]
    live = _Applying(watcher, model, names)
    cap = policy(max_bytes=4000, high_watermark=0.5, low_watermark=0.25)
    runner = GcRunner(tree.layout, tree.store, cap, live=live, disk_usage=big_disk)
    try:
        watcher.start()
        assert watcher.watch(NS)
        for n in names:
            store_page(d, n, 1000, mtime=T0)
        wait_for(lambda: len(watcher.queue), lambda k: k == len(names), what="the stores")
        batch = [watcher.queue.popleft() for _ in names]
        settle = pages._settle

        def gc_runs_meanwhile(b: Any, now: float) -> Any:  # (after the stats, before the rows)
            runner._cycle(runner.tick)
            return settle(b, now)

        pages._settle = gc_runs_meanwhile  # type: ignore[method-assign]
        pages.apply(batch, now=T0)
        pages._settle = settle  # type: ignore[method-assign]
        assert len(tree.files(NS)) < len(names)  # GC took stores while the index applied them
        time.sleep(0.3)  # (the IN_DELETE of its unlinks are read by now)
        pages.apply(list(watcher.queue), now=T0 + 1)  # the index's next batch
        rows = {n for (n,) in tree.store.conn.execute("SELECT name FROM pages")}
        assert rows == tree.files(NS)
        assert {n for n in names if model.names(NS, n[:64])} == tree.files(NS)
    finally:
        watcher.stop()
        runner.leadership.release()
        tree.store.close()


def test_a_name_expected_in_a_dir_no_watch_saw_is_not_expected_for_ever(tmp_path: Path) -> None:
    """A purge and an init of the same namespace within one index batch: the inotify thread
    watches the new dir, then the index thread, handling the purge's NS_GONE, unwatches it
    until the NS_ADDED after it (indexer._apply_namespace_event). GC, planning from the old
    dir's rows (kept: the dir is back), deletes in the new one meanwhile: no IN_DELETE comes
    for those names. Expected for ever, each would hide the next deletion of its name by
    anyone else (the same prefix is stored again under the same hash), until MOST names or an
    overflow; after a minute they are not GC's any more."""
    now = [1000.0]
    tree = Tree.at(tmp_path / "root")
    watcher = Watcher(tree.layout, own=OwnDeletions(clock=lambda: now[0]))
    names = [page(i) for i in range(1, 5)]
    try:
        _watched(tree, watcher, names)
        d = tree.dir(NS)
        d.rename(tmp_path / "trash")  # the purge
        tree.write(NS, names, at=T0)  # the init, and the engine storing the same prefix
        wait_for(lambda: watcher.has(NS), bool, what="the new dir's watch")
        watcher.unwatch(NS)  # the index thread, at the purge's NS_GONE
        model = ChainModel.from_index(tree.store.conn, [NS])
        plan = tree.plan(policy(max_bytes=2000, low_watermark=0.5), now=time.time(), model=model)
        gone: list[str] = []
        execute_gc(plan, tree.run(), unlinking=watcher.own, recorded=lambda _, n: gone.extend(n))
        assert gone and not set(gone) & tree.files(NS)
        assert watcher.watch(NS)  # the index thread, at the NS_ADDED
        now[0] += STALE
        store_page(d, gone[0], 1000)  # stored again, then deleted by someone else
        (d / gone[0]).unlink()
        wait_for(lambda: _gone(watcher), lambda g: gone[0] in g, what="the later deletion")
    finally:
        watcher.stop()
        tree.store.close()


def test_in_a_nested_dir_its_own_deletions_are_dropped_and_others_are_not(
    layout: Layout, store: Store
) -> None:
    """vLLM's hashed dirs, each its own watch: GC's deletions there are told by their path
    below the namespace dir (the watch's dir and the event's name) and dropped as the inotify
    buffer is read; a deletion by someone else in the same dirs, between them, is queued."""
    ns, d, folder = vllm_tree(layout, store)
    paths = [block_path(folder, key(i)) for i in range(40)]
    for rel in paths:
        vllm_store(d, rel)
    watcher = Watcher(layout)
    try:
        watcher.start()
        assert watcher.watch(ns)
        ours, theirs = paths[:30], paths[30:]
        watcher.own.expect(ns, ours)
        for i, rel in enumerate(ours):
            (d / rel).unlink()
            if i % 10 == 0:
                (d / theirs[i // 10]).unlink()
        watcher.own.settle(ns, ours, set(ours))
        want = set(theirs[:3])
        wait_for(lambda: _gone(watcher), lambda g: g == want, what="the foreign deletions")
        time.sleep(0.2)  # (every event of the unlinks is read by now)
        assert _gone(watcher) == want and len(watcher.own) == 0
    finally:
        watcher.stop()


def test_reading_a_buffer_drops_only_a_files_own_deletion() -> None:
    """A kernel buffer as inotify fills it: GC's deletion of a file goes; the same name's
    deletion in another watch, a dir's deletion, a store and an overflow stay; a global event
    (wd -1, not an overflow) goes as watchdog drops it."""
    own = {(1, b"a.bin")}
    reader = _Reader(lambda idle: None, lambda wd, name: (wd, name) in own, lambda: None)
    try:
        events = [
            (1, C.IN_DELETE, b"a.bin"),
            (2, C.IN_DELETE, b"a.bin"),
            (1, C.IN_DELETE | C.IN_ISDIR, b"a.bin"),
            (1, C.IN_MOVED_TO, b"a.bin"),
            (-1, C.IN_Q_OVERFLOW, b""),
            (-1, C.IN_IGNORED, b""),
        ]
        got = reader.events(b"".join(_raw(*e) for e in events))
    finally:
        reader._close_resources()  # (never started: no thread to close them)
    assert [(e.wd, e.mask, e.name) for e in got] == events[1:5]


def _raw(wd: int, mask: int, name: bytes) -> bytes:
    """One `struct inotify_event` as the kernel writes it: the name padded with NULs."""
    padded = name + b"\0" * (16 - len(name) % 16) if name else b""
    return struct.pack("iIII", wd, mask, 0, len(padded)) + padded


def test_a_deleted_dirs_watch_is_not_asked_about_deletions_any_more(tmp_path: Path) -> None:
    """The namespace dir removed (an rm -r, not a purge): its watch ends, and nothing of it is
    kept to tell GC's deletions by (a vLLM tree's thousands of dirs, made and removed)."""
    tree = Tree.at(tmp_path / "root")
    watcher = Watcher(tree.layout)
    try:
        tree.write(NS, [page(1)], at=T0)
        watcher.start()
        assert watcher.watch(NS) and watcher._leaves
        subprocess.run(["rm", "-r", str(tree.dir(NS))], check=True)
        wait_for(lambda: dict(watcher._leaves), lambda leaves: not leaves, what="the watch gone")
    finally:
        watcher.stop()
        tree.store.close()


def test_reading_a_buffer_gives_what_watchdog_gives_when_nothing_is_own() -> None:
    """The parser against watchdog's own `read_events` filter, event for event: names of no
    bytes, padded with many NULs, not UTF-8; IN_IGNORED; an overflow and a global event."""
    reader = _Reader(lambda idle: None, lambda wd, name: False, lambda: None)
    raw = b"".join(
        [
            _raw(3, C.IN_DELETE, b""),
            struct.pack("iIII", 3, C.IN_DELETE, 0, 64) + b"a.bin" + b"\0" * 59,
            _raw(3, C.IN_DELETE, b"\xff\xfe.bin"),
            _raw(3, C.IN_MOVED_TO, b"x" * 255),
            _raw(3, C.IN_IGNORED, b""),
            _raw(-1, C.IN_Q_OVERFLOW, b""),
            _raw(-1, C.IN_UNMOUNT, b""),
            _raw(4, C.IN_DELETE | C.IN_ISDIR, b"d"),
        ]
    )
    try:
        got = reader.events(raw)
        want = [
            (wd, mask, cookie, name)
            for wd, mask, cookie, name in _Reader._parse_event_buffer(raw)
            if wd != -1 or mask & C.IN_Q_OVERFLOW
        ]
    finally:
        reader._close_resources()  # (never started: no thread to close them)
    assert [(e.wd, e.mask, e.cookie, e.name) for e in got] == want
    assert [e.name for e in got][:3] == [b"", b"a.bin", b"\xff\xfe.bin"] and len(got) == 7


def test_a_same_named_block_in_another_hashed_dir_is_not_taken_for_gcs(
    layout: Layout, store: Store
) -> None:
    """vLLM's layout puts the same file name in two dirs (another KV cache group): GC's
    deletion of one is not the deletion of the other, whichever comes first."""
    ns, d, folder = vllm_tree(layout, store)
    ours, theirs = block_path(folder, key(7), group=0), block_path(folder, key(7), group=1)
    assert ours.rpartition("/")[2] == theirs.rpartition("/")[2]
    for rel in (ours, theirs):
        vllm_store(d, rel)
    watcher = Watcher(layout)
    try:
        watcher.start()
        assert watcher.watch(ns)
        wait_for(lambda: len(watcher._leaves), lambda n: n >= 2, what="both leaf watches")
        watcher.own.expect(ns, [ours])
        (d / theirs).unlink()  # someone else, first
        wait_for(lambda: _gone(watcher), lambda g: theirs in g, what="the foreign deletion")
        assert len(watcher.own) == 1
        (d / ours).unlink()  # GC's
        watcher.own.settle(ns, [ours], {ours})
        wait_for(lambda: len(watcher.own), lambda n: n == 0, what="GC's deletion taken")
        time.sleep(0.2)
        assert _gone(watcher) == {theirs}
    finally:
        watcher.stop()


def test_a_namespace_dir_renamed_keeps_its_watch_and_tells_own_deletions_by_the_new_name(
    tmp_path: Path,
) -> None:
    """`mv ns/A ns/B`: one kernel watch, the descriptor shared by A's dead callback and B's.
    GC's deletions in B are dropped, an operator's are queued, before and after the index
    thread unwatches A; names GC expects under A are never taken for B's."""
    tree = Tree.at(tmp_path / "root")
    watcher = Watcher(tree.layout)
    names = [page(i) for i in range(1, 7)]
    try:
        _watched(tree, watcher, names)
        wd = next(iter(watcher._leaves))
        os.rename(tree.dir(NS), tree.layout.ns_dir(NS2))
        wait_for(lambda: watcher.has(NS2), bool, what="the new name's watch")
        assert watcher._leaves[wd].ns_id == NS2
        d = tree.layout.ns_dir(NS2)
        watcher.own.expect(NS, [names[0]])  # (a plan of the old name's rows)
        watcher.own.expect(NS2, [names[1]])
        for n in names[:3]:
            (d / n).unlink()
        wait_for(lambda: _gone(watcher), lambda g: {names[0], names[2]} <= g, what="deletions")
        watcher.unwatch(NS)  # the index thread, at NS's NS_GONE
        assert watcher._leaves[wd].ns_id == NS2
        watcher.own.expect(NS2, [names[3]])
        for n in names[3:5]:
            (d / n).unlink()
        wait_for(lambda: _gone(watcher), lambda g: names[4] in g, what="the later deletion")
        time.sleep(0.2)
        assert _gone(watcher) == {names[0], names[2], names[4]}
    finally:
        watcher.stop()
        tree.store.close()


class _OperatorInTheChunk:
    """GC's `unlinking`, and an operator who deletes a page the chunk refused (immutable, made
    mutable again) in the moment between its check and the chunk's end, read by the watcher
    before GC settles."""

    def __init__(self, watcher: Watcher, d: Path, victim: str) -> None:
        self.watcher, self.d, self.victim = watcher, d, victim

    def expect(self, ns: str, names: Sequence[str]) -> None:
        self.watcher.own.expect(ns, names)

    def settle(self, ns: str, names: Sequence[str], deleted: Collection[str]) -> None:
        if self.victim in names and self.victim not in deleted and (self.d / self.victim).exists():
            _pinned(self.d / self.victim, False)
            (self.d / self.victim).unlink()
            left = len(names) - len(deleted) - 1  # (every event of the chunk read)
            wait_for(lambda: len(self.watcher.own), lambda n: n == left, what="the reads")
        self.watcher.own.settle(ns, names, deleted)

    def again(self, ns: str, names: Sequence[str]) -> Collection[str]:
        return self.watcher.own.again(ns, names)


def test_a_page_gc_refused_and_someone_deleted_before_it_settled_leaves_no_row(
    tmp_path: Path,
) -> None:
    """GC expected a page, refused it (immutable), and someone else deleted it before the
    chunk settled: the watcher took that IN_DELETE for GC's, but GC deleted no such file and
    kept its row. The deletion reaches the index all the same (a GONE, which the index checks
    with a stat), so no row outlives its file until a reconcile."""
    tree = Tree.at(tmp_path / "root")
    watcher = Watcher(tree.layout)
    d = tree.dir(NS)
    try:
        plan = _watched_cap_plan(tree, watcher)
        kept = evicted(plan)[0]
        _pinned(d / kept, True)
        deleted: set[str] = set()
        told = _OperatorInTheChunk(watcher, d, kept)
        execute_gc(plan, tree.run(), unlinking=told, recorded=lambda _, n: deleted.update(n))
        assert kept not in deleted and not (d / kept).exists()
        wait_for(lambda: _gone(watcher), lambda g: kept in g, what="the operator's deletion")
        assert len(watcher.own) == 0
        tree.rec.apply(list(watcher.queue), now=time.time())  # the index's next batch
        assert {n for (n,) in tree.store.conn.execute("SELECT name FROM pages")} == tree.files(NS)
    finally:
        watcher.stop()
        tree.store.close()
        for name in os.listdir(d):
            _pinned(d / name, False)


def test_names_of_a_chunk_the_purge_cut_short_are_not_queued_for_its_gone_dir(
    tmp_path: Path,
) -> None:
    """A purge moved the namespace dir away while GC's chunk ran (its names not reached, the
    watcher forgot what GC expected there): nothing of that chunk is queued after its
    NS_GONE, whose rows went with the namespace."""
    tree = Tree.at(tmp_path / "root")
    watcher = Watcher(tree.layout)
    names = [page(i) for i in range(1, 4)]
    try:
        _watched(tree, watcher, names)
        watcher.own.expect(NS, names)
        tree.dir(NS).rename(tmp_path / "trash")  # the purge
        wait_for(lambda: [e[0] for e in watcher.queue], lambda k: Kind.NS_GONE in k, what="it")
        watcher.own.settle(NS, names, set())  # not reached
        time.sleep(0.1)
        assert not _gone(watcher)
    finally:
        watcher.stop()
        tree.store.close()


def test_gcs_deletion_a_store_again_and_an_operators_deletion_of_one_name(tmp_path: Path) -> None:
    """GC deletes a page, the engine stores the same name again and an operator deletes it,
    all within one read of the kernel's queue or across several: only GC's is dropped."""
    tree = Tree.at(tmp_path / "root")
    watcher = Watcher(tree.layout)
    d = tree.dir(NS)
    names = [page(i) for i in range(1, 21)]
    try:
        _watched(tree, watcher, names)
        watcher.own.expect(NS, names)
        for n in names:
            (d / n).unlink()  # GC's
            store_page(d, n, 100)  # the engine's
            (d / n).unlink()  # the operator's
        watcher.own.settle(NS, names, set(names))
        wait_for(lambda: _gone(watcher), lambda g: g == set(names), what="the operator's")
        kinds = [(k, n) for k, ns, n, *_ in list(watcher.queue) if k is not Kind.READ]
        assert kinds == [(k, n) for n in names for k in (Kind.WRITE, Kind.GONE)]
        assert len(watcher.own) == 0
    finally:
        watcher.stop()
        tree.store.close()


def test_a_purge_while_gc_unlinks_elsewhere_does_not_break_the_inotify_thread() -> None:
    """A namespace purged (its expected names forgotten, on the inotify thread) while a GC
    run expects and settles chunks of another (on its thread): the forgetting never fails
    (a RuntimeError there ended the inotify thread, and every event after it was lost)."""
    own = OwnDeletions()
    own.expect(NS2, [str(i) for i in range(20_000)])
    stop, failed = threading.Event(), []

    def gc_run() -> None:
        names = [page(i) for i in range(CHUNK)]
        while not stop.is_set():
            own.expect(NS, names)
            own.settle(NS, names, set())

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # (the threads take turns often, as under load)
    runner = threading.Thread(target=gc_run)
    runner.start()
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not failed:
            try:
                own.forget("0000000000000000")
            except RuntimeError as e:
                failed.append(e)
    finally:
        stop.set()
        runner.join()
        sys.setswitchinterval(switch)
    assert not failed


def test_a_watchdog_without_the_internals_the_reader_uses_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader calls watchdog's private `_read_event_buffer`: a release that renamed it
    would end the inotify thread at its first read, after the daemon said it was ready. The
    watcher refuses to start instead, with a one-line error that names the fix."""
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    monkeypatch.delattr(InotifyFD, "_read_event_buffer")
    with pytest.raises(ConfigError, match=r"install watchdog>=7\.1,<8"):
        Watcher(layout).start()
