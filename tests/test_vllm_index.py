"""The live index of a vLLM namespace (nested hashed dirs) against real inotify events: blocks
stored as vLLM stores them, in dirs made on the fly, counted once each; loads counted as reads;
deletions seen; the manifest's engine decides how the dir is read."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator

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
