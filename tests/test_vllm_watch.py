"""The live index of a vLLM namespace as an operator's bad day or a hostile co-tenant leaves
its hashed dirs: an inotify overflow while dirs are made, a dir removed and made again, a dir
moved out, another filesystem mounted in a hashed dir, a root mounted noatime."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest

from cachemgr.layout import Layout
from cachemgr.state.store import Store
from tests.nsfixtures import cli
from tests.polling import wait_for
from tests.test_indexer import SlowWatcher, ns_stats, reader, start
from tests.vllmtrees import SIZE, block_path, key, sibling, vllm_load, vllm_store, vllm_tree

__all__ = ["reader"]  # the fixture


def test_after_an_overflow_blocks_stored_in_dirs_made_during_it_are_still_counted(
    layout: Layout, store: Store, reader: sqlite3.Connection
) -> None:
    ns, d, folder = vllm_tree(layout, store)
    first = block_path(folder, key(0))
    pair = [first, sibling(first)]
    for rel in pair:
        vllm_store(d, rel, SIZE)
    watcher = SlowWatcher(layout)
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
        twin = sibling(during[3], "e")
        vllm_store(d, twin, SIZE)
        wait_for(lambda: ns_stats(reader, ns)[:2], lambda s: s == (32, 32 * SIZE), timeout=10)
    finally:
        watcher.release.set()
        ix.stop()


def test_a_hashed_dir_removed_and_made_again_is_watched_again(
    layout: Layout, store: Store, reader: sqlite3.Connection
) -> None:
    ns, d, folder = vllm_tree(layout, store)
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
        vllm_store(d, sibling(rel), SIZE)  # in the dir made last: watched
        wait_for(lambda: ns_stats(reader, ns)[:3], lambda s: s == (2, 2 * SIZE, 0))
        assert vllm_load(d, rel) == SIZE
        wait_for(lambda: ns_stats(reader, ns)[2], lambda r: r == 1)
    finally:
        ix.stop()


def test_a_hashed_dir_on_another_mount_is_not_watched(
    layout: Layout, store: Store, reader: sqlite3.Connection, tmp_path: Path
) -> None:
    ns, d, folder = vllm_tree(layout, store)
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
        vllm_store(d, sibling(rel, "e"), SIZE)
        vllm_store(d, block_path(folder, key(3)), SIZE)  # reported after the one above
        wait_for(lambda: ns_stats(reader, ns)[:2], lambda s: s == (3, 3 * SIZE))
    finally:
        ix.stop()
        subprocess.run(["umount", "-l", str(at)], check=True)


def test_a_hashed_dir_moved_out_of_the_namespace_leaves_the_index(
    layout: Layout, store: Store, reader: sqlite3.Connection, tmp_path: Path
) -> None:
    ns, d, folder = vllm_tree(layout, store)
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


def test_on_a_noatime_root_reads_before_a_watch_are_lost_but_counted_and_said(
    layout: Layout, store: Store, reader: sqlite3.Connection
) -> None:
    """noatime leaves no trace of a read: the loads made before their dirs' watches stay
    unseen, the stores of those dirs bound them (the metric's count), and doctor says why."""
    ns, d, folder = vllm_tree(layout, store)
    root = str(layout.root)
    for argv in (["--bind", root, root], ["-o", "remount,bind,noatime", root]):
        mounted = subprocess.run(["mount", *argv], capture_output=True)
        if mounted.returncode != 0:
            subprocess.run(["umount", "-l", root])
            pytest.skip(f"cannot remount noatime here: {mounted.stderr.decode().strip()}")
    try:
        first = block_path(folder, key(0))
        vllm_store(d, first, SIZE)
        watcher = SlowWatcher(layout)
        ix = start(layout, store, watcher)
        try:
            vllm_store(d, sibling(first), SIZE)  # a watched dir: its event blocks the thread
            later = [block_path(folder, key(i)) for i in range(1, 11)]
            for rel in later:
                vllm_store(d, rel, SIZE)
                assert vllm_load(d, rel) == SIZE
            watcher.release.set()
            wait_for(lambda: ns_stats(reader, ns), lambda s: s == (12, 12 * SIZE, 0, 11))
            assert (watcher.gaps.stores, watcher.gaps.reads) == (10, 0)
        finally:
            watcher.release.set()
            ix.stop()
        out = cli("--root", root, "doctor", "--json")
        codes = [f["code"] for f in json.loads(out.stdout)]
        assert (out.returncode, codes) == (1, ["root-noatime"]), out.stdout
    finally:
        subprocess.run(["umount", "-l", root], check=True)
    assert "root-noatime" not in cli("--root", root, "doctor", "--json").stdout
