"""The live index of a vLLM namespace (nested hashed dirs) against real inotify events: blocks
stored as vLLM stores them, in dirs made on the fly, counted once each; loads counted as reads;
deletions seen; the manifest's engine decides how the dir is read."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachemgr.daemon.indexer import Indexer
from cachemgr.daemon.watcher import Event, Watcher
from cachemgr.layout import Layout
from cachemgr.state.store import Store, connect
from tests.polling import wait_for
from tests.vllmtrees import block_path, key, vllm_load, vllm_namespace, vllm_store, write_folder

SIZE = 4096


@pytest.fixture
def reader(layout: Layout, store: Store) -> Iterator[sqlite3.Connection]:
    conn = connect(layout.db_path)
    yield conn
    conn.close()


def ns_stats(conn: sqlite3.Connection, ns: str) -> tuple[int, ...]:
    """(pages, bytes, lifetime reads, lifetime writes)."""
    row = conn.execute(
        "SELECT pages, bytes, page_reads, page_writes FROM namespace_stats WHERE namespace_id = ?",
        (ns,),
    ).fetchone()
    return tuple(row) if row else (0, 0, 0, 0)


def start(layout: Layout, store: Store, watcher: Watcher | None = None) -> Indexer:
    ix = Indexer(layout, store, batch_interval=0.05, watcher=watcher)
    ix.start()
    assert ix.state.ready.wait(10)
    return ix


def test_blocks_stored_in_new_hashed_dirs_and_loaded_are_each_counted_once(
    layout: Layout, store: Store, reader: sqlite3.Connection
) -> None:
    ns = vllm_namespace(layout, store)
    d = layout.ns_dir(ns)
    folder = write_folder(d)
    old = block_path(folder, key(10_000))
    vllm_store(d, old, SIZE)  # before the daemon: indexed by the scan, not a write
    ix = start(layout, store)
    try:
        wait_for(lambda: ns_stats(reader, ns), lambda s: s[:2] == (1, SIZE))
        blocks = [block_path(folder, key(i)) for i in range(300)]
        for rel in blocks:
            vllm_store(d, rel, SIZE)
        for rel in [*blocks[:120], old]:
            assert vllm_load(d, rel) == SIZE
        wait_for(lambda: ns_stats(reader, ns), lambda s: s == (301, 301 * SIZE, 121, 300))
        (d / blocks[0]).unlink()
        wait_for(lambda: ns_stats(reader, ns)[:2], lambda s: s == (300, 300 * SIZE))

    finally:
        ix.stop()


class HeldWatcher(Watcher):
    """A watcher whose inotify thread stalls on its first event, as a busy daemon's would."""

    def __init__(self, layout: Layout) -> None:
        super().__init__(layout)
        self.release = threading.Event()

    def emit(self, event: Event) -> None:
        self.release.wait(30)
        super().emit(event)


def test_a_block_stored_before_its_new_dir_is_watched_is_still_counted_once(
    layout: Layout, store: Store, reader: sqlite3.Connection
) -> None:
    ns = vllm_namespace(layout, store)
    d = layout.ns_dir(ns)
    folder = write_folder(d)
    first = block_path(folder, key(0))
    vllm_store(d, first, SIZE)
    watcher = HeldWatcher(layout)
    ix = start(layout, store, watcher)
    try:
        sibling = first[: first.rindex("/") + 1] + key(0)[:5] + "f" * 59 + ".bin"
        vllm_store(d, sibling, SIZE)  # a watched dir: its event blocks the inotify thread
        # Every dir below is made, and its block stored, before any watch on it exists.
        later = [block_path(folder, key(i)) for i in range(1, 60)]
        for rel in later:
            vllm_store(d, rel, SIZE)
        watcher.release.set()
        wait_for(lambda: ns_stats(reader, ns), lambda s: s == (61, 61 * SIZE, 0, 60))
        vllm_store(d, block_path(folder, key(500)), SIZE)  # and the new dirs are watched now
        assert vllm_load(d, later[5]) == SIZE
        wait_for(lambda: ns_stats(reader, ns), lambda s: s == (62, 62 * SIZE, 1, 61))
    finally:
        ix.stop()


def test_after_an_overflow_blocks_stored_in_dirs_made_during_it_are_still_counted(
    layout: Layout, store: Store, reader: sqlite3.Connection
) -> None:
    ns = vllm_namespace(layout, store)
    d = layout.ns_dir(ns)
    folder = write_folder(d)
    first = block_path(folder, key(0))
    pair = [first, first[: first.rindex("/") + 1] + key(0)[:5] + "f" * 59 + ".bin"]
    for rel in pair:
        vllm_store(d, rel, SIZE)
    watcher = HeldWatcher(layout)
    ix = start(layout, store, watcher)
    try:
        limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
        wait_for(lambda: ns_stats(reader, ns)[:2], lambda s: s == (2, 2 * SIZE))
        vllm_load(d, first)  # a watched dir's event: the inotify thread now blocks
        for i in range(2 * limit):  # reads until the kernel queue overflows (see test_indexer)
            os.close(os.open(d / pair[i % 2], os.O_RDONLY))
        # dirs the kernel can no longer report: their watches come from the rescan or never
        during = [block_path(folder, key(i)) for i in range(1, 30)]
        for rel in during:
            vllm_store(d, rel, SIZE)
        watcher.release.set()
        wait_for(lambda: ix.state.overflows, lambda n: n >= 1, timeout=30)
        wait_for(lambda: ns_stats(reader, ns)[:2], lambda s: s == (31, 31 * SIZE), timeout=30)
        # a second block in a dir made during the overflow, live (no reconcile is due)
        twin = during[3][: during[3].rindex("/") + 1] + key(4)[:5] + "e" * 59 + ".bin"
        vllm_store(d, twin, SIZE)
        wait_for(lambda: ns_stats(reader, ns)[:2], lambda s: s == (32, 32 * SIZE), timeout=10)
    finally:
        watcher.release.set()
        ix.stop()


def test_a_hashed_dir_removed_and_made_again_is_watched_again(
    layout: Layout, store: Store, reader: sqlite3.Connection
) -> None:
    ns = vllm_namespace(layout, store)
    d = layout.ns_dir(ns)
    folder = write_folder(d)
    rel = block_path(folder, key(0))
    vllm_store(d, rel, SIZE)
    ix = start(layout, store)
    try:
        wait_for(lambda: ns_stats(reader, ns)[:2], lambda s: s == (1, SIZE))
        for _ in range(20):  # a person's rm -r, and vLLM's next store, again and again
            shutil.rmtree(d / f"{folder}_r0")
            wait_for(lambda: ns_stats(reader, ns)[:2], lambda s: s == (0, 0))
            vllm_store(d, rel, SIZE)
            wait_for(lambda: ns_stats(reader, ns)[:2], lambda s: s == (1, SIZE))
        sibling = rel[: rel.rindex("/") + 1] + key(0)[:5] + "f" * 59 + ".bin"
        vllm_store(d, sibling, SIZE)  # in the dir made last: watched
        wait_for(lambda: ns_stats(reader, ns)[:3], lambda s: s == (2, 2 * SIZE, 0))
        assert vllm_load(d, rel) == SIZE
        wait_for(lambda: ns_stats(reader, ns)[2], lambda r: r == 1)
    finally:
        ix.stop()


def test_a_hashed_dir_on_another_mount_is_not_watched(
    layout: Layout, store: Store, reader: sqlite3.Connection, tmp_path: Path
) -> None:
    ns = vllm_namespace(layout, store)
    d = layout.ns_dir(ns)
    folder = write_folder(d)
    vllm_store(d, block_path(folder, key(0)), SIZE)
    ix = start(layout, store)
    other = tmp_path / "other-fs"
    other.mkdir()
    rel = block_path(folder, key(1))
    at = d / rel.rpartition("/")[0]
    at.parent.mkdir(parents=True)
    at.mkdir()  # made empty, then a bind mount over it: the watch would be on the mount's dir
    mounted = subprocess.run(["mount", "--bind", str(other), str(at)], capture_output=True)
    if mounted.returncode != 0:
        ix.stop()
        pytest.skip(f"cannot bind-mount here: {mounted.stderr.decode().strip()}")
    try:
        vllm_store(d, rel, SIZE)  # lands on the other filesystem
        vllm_store(d, block_path(folder, key(2)), SIZE)  # a dir made after it: watched
        wait_for(lambda: ns_stats(reader, ns)[:2], lambda s: s == (2, 2 * SIZE))
        ix.stop()
        ix = start(layout, store)  # a scan from scratch agrees, and watches what it scans
        wait_for(lambda: ns_stats(reader, ns)[:2], lambda s: s == (2, 2 * SIZE))
        vllm_store(d, rel[: rel.rindex("/") + 1] + key(1)[:5] + "e" * 59 + ".bin", SIZE)
        vllm_store(d, block_path(folder, key(3)), SIZE)  # reported after the one above
        wait_for(lambda: ns_stats(reader, ns)[:2], lambda s: s == (3, 3 * SIZE))
    finally:
        ix.stop()
        subprocess.run(["umount", "-l", str(at)], check=True)


def test_a_hashed_dir_moved_out_of_the_namespace_leaves_the_index(
    layout: Layout, store: Store, reader: sqlite3.Connection, tmp_path: Path
) -> None:
    ns = vllm_namespace(layout, store)
    d = layout.ns_dir(ns)
    folder = write_folder(d)
    blocks = [block_path(folder, key(i)) for i in range(40)]
    for rel in blocks:
        vllm_store(d, rel, SIZE)
    ix = start(layout, store)
    try:
        wait_for(lambda: ns_stats(reader, ns)[:2], lambda s: s == (40, 40 * SIZE))
        os.rename(d / f"{folder}_r0", tmp_path / "aside")  # an operator's mv, a backup
        wait_for(lambda: ns_stats(reader, ns)[:2], lambda s: s == (0, 0), timeout=10)
        # and what happens in the dir moved away is not the namespace's any more
        vllm_store(
            tmp_path / "aside", blocks[0].partition("/")[2].replace(key(0)[5:9], "0000"), SIZE
        )
        vllm_store(d, blocks[1], SIZE)  # reported after the one above
        wait_for(lambda: ns_stats(reader, ns)[:2], lambda s: s == (1, SIZE), timeout=10)
    finally:
        ix.stop()
