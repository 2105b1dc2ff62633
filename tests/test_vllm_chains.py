"""The chains cachemgr learns from vLLM 0.34.0's own fs tier (FileSystemTierManager, via
tests/vllm_driver.py). vLLM stores a request's new blocks in order (one IN_MOVED_TO each; a
block on disk already is skipped without an event) and loads a hit prefix head to tail (one
IN_CLOSE_NOWRITE each), and nothing on disk marks where one request's store job ends and the
next one's begins: store order is no evidence, load order is. So prompts stored and never
loaded are not chained newest last (under a cap the oldest goes first), and loads link a
prompt's blocks."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import pytest

from cachemgr.daemon.events import LOCAL, Kind
from cachemgr.daemon.page_events import PageEvents
from cachemgr.layout import Layout
from cachemgr.state.store import Store
from tests.conftest import VllmDriver
from tests.daemon_helpers import page_name, register_namespace, running_daemon, store_page
from tests.polling import wait_for
from tests.test_vllm_daemon import (
    NS,
    PROMPT,
    blocks,
    on_disk,
    settings,
    two_prompts_cap,
    vllm_root,
)
from tests.vllmtrees import block_path, key, vllm_store, vllm_tree


def preds(layout: Layout, ns: str) -> dict[str, str | None]:
    """Each indexed file's stored predecessor key."""
    with sqlite3.connect(layout.db_path) as conn:
        rows = conn.execute("SELECT name, pred FROM pages WHERE namespace_id = ?", (ns,))
        return dict(rows.fetchall())


def test_a_vllm_namespace_links_by_loads_and_an_sglang_one_by_stores_too(
    layout: Layout, store: Store
) -> None:
    """The index of a vLLM namespace makes no guess from store order; two loads that agree
    link. An SGLang namespace's stores are still its first guess."""
    ns, d, folder = vllm_tree(layout, store)
    a, b = ([block_path(folder, key(i)) for i in r] for r in (range(4), range(4, 8)))
    sglang = register_namespace(layout, "00000000000000c3", identity=None)
    pages = [page_name(i) for i in range(3)]
    for rel in a + b:
        vllm_store(d, rel)
    for name in pages:
        store_page(sglang, name)
    events = PageEvents(layout, store)  # its model reads each namespace's format
    stores = [(Kind.WRITE, ns, rel, 0.0, LOCAL) for rel in a + b]
    events.apply(
        [*stores, *((Kind.WRITE, sglang.name, n, 0.0, LOCAL) for n in pages)], now=time.time()
    )
    assert preds(layout, ns) == dict.fromkeys(a + b)
    assert [preds(layout, sglang.name)[n] for n in pages] == [None, *(n[:64] for n in pages[:2])]
    for _ in range(2):  # a request loading prompt a, twice
        events.apply([(Kind.READ, ns, rel, 0.0, LOCAL) for rel in a], now=time.time())
    assert preds(layout, ns) == {**dict.fromkeys(a + b), **dict(zip(a[1:], a[:-1], strict=True))}


@pytest.mark.vllm
def test_write_only_prompts_are_evicted_oldest_first(vllm: VllmDriver, tmp_path: Path) -> None:
    """Prompts A, B, C stored one after another, none loaded, then a cap one prompt short: A's
    blocks go, C's stay whole."""
    layout, ns_dir = vllm_root(tmp_path)
    with running_daemon(two_prompts_cap(layout)):
        tier = vllm.open(ns_dir, block_tokens=16, dtype="bfloat16", slots=64)["handle"]
        try:
            paths = {
                name: vllm.call("store", handle=tier, tokens=blocks(seed, PROMPT), tag="a")["paths"]
                for name, seed in (("A", 1), ("B", 2), ("C", 3))
            }
            wait_for(
                lambda: len(on_disk(ns_dir)), lambda n: n <= 2 * PROMPT, timeout=60, what="the cap"
            )
        finally:
            vllm.call("close", handle=tier)
    left = {name: sum(map(os.path.exists, p)) for name, p in paths.items()}
    # GC frees ahead of the writer at its measured write rate: on a loaded host a page or two
    # of B may follow A's last. C, the newest, stays whole.
    assert (left["A"], left["C"]) == (0, PROMPT) and left["B"] > PROMPT // 2


@pytest.mark.vllm
def test_the_blocks_vllm_loads_are_linked_head_to_tail(vllm: VllmDriver, tmp_path: Path) -> None:
    """Two requests load prompt A (vLLM's own load path, seen as reads): its blocks are linked in
    the index, each to the one before; B, stored and never loaded, stays unlinked."""
    layout, ns_dir = vllm_root(tmp_path)
    with running_daemon(settings(layout)) as dm:
        tier = vllm.open(ns_dir, block_tokens=16, dtype="bfloat16", slots=64)["handle"]
        try:
            a, b = (
                vllm.call("store", handle=tier, tokens=blocks(s, PROMPT), tag="a")["paths"]
                for s in (1, 2)
            )
            # A server reads a page long after its store, once the watcher watches the hashed
            # dir it made. A read racing that watch (a loaded box's watcher lags) is counted
            # from its atime once the watcher caught up: a second load meanwhile comes before
            # it, and this test is about that order (test_vllm_daemon.py counts racing reads).
            wait_for(lambda: dm.namespaces()[NS]["pages"], lambda n: n == 2 * PROMPT, timeout=60)
            for req in ("r1", "r2"):
                got = vllm.call("load", handle=tier, tokens=blocks(1, PROMPT), tag="a", req=req)
                assert got["loaded"] == got["correct"] == PROMPT
        finally:
            vllm.call("close", handle=tier)
        wait_for(
            lambda: dm.namespaces()[NS]["reads_since_start"], lambda n: n == 2 * PROMPT, timeout=60
        )
    rel = [[os.path.relpath(p, ns_dir) for p in ps] for ps in (a, b)]
    links = preds(layout, NS)
    assert [links[r] for r in rel[0]] == [None, *rel[0][:-1]]
    assert [links[r] for r in rel[1]] == [None] * PROMPT
