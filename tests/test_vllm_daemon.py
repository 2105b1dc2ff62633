"""cachemgr's daemon over vLLM 0.34.0's own fs tier (FileSystemTierManager, via
tests/vllm_driver.py) writing into a vLLM namespace: counts in /metrics equal what vLLM stored
and loaded, a cap holds while vLLM writes, GC leaves config.json, foreign files and whatever a
planted symlink leads to, and a block GC deleted under the running tier is a miss."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.settings import Settings, load_settings
from tests.conftest import VllmDriver
from tests.daemon_helpers import register_namespace, running_daemon
from tests.polling import wait_for
from tests.test_server import metric

pytestmark = pytest.mark.vllm
NS = "00000000000000a1"
BLOCK = 4096  # the driver's block_bytes
PROMPT = 8  # blocks of a prompt
IDENTITY = {
    "engine": "vllm",
    "kv_cache_dtype": "bfloat16",
    "page_size": 16,
    "source": {"served_model_name": "Qwen/Qwen3-0.6B"},
}


def blocks(seed: int, n: int) -> list[list[int]]:
    """A prompt of n blocks of 16 tokens."""
    return [[seed, 16 * n]]


def vllm_root(tmp_path: Path) -> tuple[Layout, Path]:
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    return layout, register_namespace(layout, NS, instance="vllm-0", identity=IDENTITY)


def settings(layout: Layout, **gc: Any) -> Settings:
    return load_settings(root=layout.root, batch_interval=0.05, gc_interval=3600, **gc)


def two_prompts_cap(layout: Layout) -> Settings:
    """A root cap half a block over two prompts: a third one's store evicts one prompt."""
    return settings(
        layout,
        gc_max_bytes=2 * PROMPT * BLOCK + BLOCK // 2,
        gc_high_watermark=1.0,
        gc_low_watermark=0.98,
        gc_delete_rate=None,
    )


def on_disk(ns_dir: Path) -> list[Path]:
    return [p for p in ns_dir.rglob("*.bin") if p.is_file() and not p.is_symlink()]


def test_metrics_count_the_blocks_vllm_stored_and_loaded(vllm: VllmDriver, tmp_path: Path) -> None:
    layout, ns_dir = vllm_root(tmp_path)
    with running_daemon(settings(layout)) as dm:

        def counts() -> tuple[float | None, ...]:
            text = dm.get("/metrics").text
            return tuple(
                metric(text, name, namespace=NS)
                for name in (
                    "cachemgr_page_writes_total",
                    "cachemgr_page_reads_total",
                    "cachemgr_namespace_pages",
                    "cachemgr_namespace_bytes",
                )
            )

        tier = vllm.open(ns_dir, block_tokens=16, dtype="bfloat16", slots=128)["handle"]
        try:
            stored = [
                vllm.call("store", handle=tier, tokens=blocks(s, 12), tag="a")["stored"]
                for s in range(5)
            ]
            again = vllm.call("store", handle=tier, tokens=blocks(0, 12), tag="a")  # skipped
            # (a server loads a block long after its store: its dir is watched by then)
            wait_for(counts, lambda c: c == (60, 0, 60, 60 * BLOCK), timeout=30, what="stores")
            loaded = [
                vllm.call("load", handle=tier, tokens=blocks(s, 12), tag="a", req=f"r{s}")
                for s in (1, 3)
            ]
        finally:
            vllm.call("close", handle=tier)
        assert stored == [12] * 5 and again["skipped"] == 12
        assert [(r["loaded"], r["correct"]) for r in loaded] == [(12, 12)] * 2
        wait_for(counts, lambda c: c == (60, 24, 60, 60 * BLOCK), timeout=30, what="metrics")
        info = dm.namespaces()[NS]
        assert info["engine"] == "vllm"


def plant(ns_dir: Path, block_dir: Path, outside: Path) -> list[Path]:
    """A foreign file among the blocks, and symlinks to `outside` at the hashed-dir levels;
    returns what must survive every GC."""
    outside.mkdir()
    victim = outside / ("f" * 64 + ".bin")
    victim.write_bytes(b"x" * BLOCK)
    (outside / "ff_g0").mkdir()
    (outside / "ff_g0" / ("e" * 64 + ".bin")).write_bytes(b"y" * BLOCK)
    leaf = next(p.parent for p in on_disk(ns_dir))
    os.symlink(victim, leaf / (leaf.parent.name + leaf.name[:2] + "0" * 59 + ".bin"))
    os.symlink(outside, block_dir / "fff")  # a hashed dir that is a link
    (leaf / "notes.txt").write_text("mine")
    return [victim, outside / "ff_g0" / ("e" * 64 + ".bin"), leaf / "notes.txt"]


def test_a_cap_holds_while_vllm_writes_and_gc_spares_config_foreign_and_links(
    vllm: VllmDriver, tmp_path: Path
) -> None:
    layout, ns_dir = vllm_root(tmp_path)
    cap_blocks = 20
    cfg = settings(
        layout,
        gc_max_bytes=cap_blocks * BLOCK,
        gc_high_watermark=1.0,
        gc_low_watermark=0.9,
        gc_delete_rate=None,
    )
    with running_daemon(cfg) as dm:
        opened = vllm.open(ns_dir, block_tokens=16, dtype="bfloat16", slots=64)
        tier = opened["handle"]
        config = Path(opened["config_path"])
        try:
            vllm.call("store", handle=tier, tokens=blocks(100, 4), tag="a")
            keep = plant(ns_dir, Path(opened["block_dir"]), tmp_path / "outside")
            for s in range(10):
                assert vllm.call("store", handle=tier, tokens=blocks(s, 8), tag="a")["failed"] == 0
            wait_for(
                lambda: len(on_disk(ns_dir)), lambda n: n <= cap_blocks, timeout=60, what="the cap"
            )
        finally:
            vllm.call("close", handle=tier)
        # /metrics shows a snapshot the daemon refreshes soon after each GC run
        wait_for(
            lambda: metric(dm.get("/metrics").text, "cachemgr_evicted_pages_total") or 0,
            lambda n: n >= 84 - cap_blocks,
            what="evictions in /metrics",
        )
    assert config.is_file() and config.read_bytes().startswith(b"{")
    for path in keep:
        assert path.exists(), path


def test_a_block_gc_deleted_under_a_running_tier_is_a_miss(
    vllm: VllmDriver, tmp_path: Path
) -> None:
    layout, ns_dir = vllm_root(tmp_path)
    # Another server's namespace under the same root cap: its stores take the root over the
    # cap, and GC takes the first server's blocks (the other's newest pages are in flight).
    other = register_namespace(layout, "00000000000000b2", instance="vllm-1", identity=IDENTITY)
    cfg = settings(
        layout,
        gc_max_bytes=8 * BLOCK,
        gc_high_watermark=1.0,
        gc_low_watermark=0.1,
        gc_delete_rate=None,
    )
    with running_daemon(cfg):
        tier = vllm.open(ns_dir, block_tokens=16, dtype="bfloat16")["handle"]
        writer = vllm.open(other, block_tokens=16, dtype="bfloat16")["handle"]
        try:
            held = vllm.call("store", handle=tier, tokens=blocks(1, 4), tag="a")["paths"]
            seen = vllm.call("lookup", handle=tier, tokens=blocks(1, 4), req="held")
            assert seen["hit"] == 4  # the tier now holds a HIT verdict for each block
            vllm.call("store", handle=writer, tokens=blocks(2, 8), tag="a")  # over the cap
            wait_for(lambda: sum(map(os.path.exists, held)), lambda n: n < 4, timeout=60, what="GC")
            got = vllm.call("load", handle=tier, tokens=blocks(1, 4), tag="a", req="held")
        finally:
            vllm.call("close", handle=tier)
            vllm.call("close", handle=writer)
    # The load stops at the first block GC took: that block and the rest of the batch are
    # misses (vLLM recomputes them), the ones before it load whole; nothing crashed.
    assert got["loaded"] < 4 and got["failed_at"] == got["loaded"] and got["wrong"] == 0
    assert set(got["lookup_after"][got["loaded"] :]) == {"MISS"}


def test_blocks_vllm_loads_before_the_daemon_watches_their_dirs_count_as_read(
    vllm: VllmDriver, tmp_path: Path
) -> None:
    """The watcher lags (its thread held at the first hashed dir vLLM makes) while vLLM stores
    prompts A and B and loads A: A's reads count (/metrics), and under a cap GC takes the
    prompt never read, B, before A."""
    layout, ns_dir = vllm_root(tmp_path)
    with running_daemon(two_prompts_cap(layout)) as dm:

        def counted() -> tuple[float | None, ...]:
            text = dm.get("/metrics").text
            return (
                metric(text, "cachemgr_page_reads_total", namespace=NS),
                metric(text, "cachemgr_namespace_pages", namespace=NS),
                metric(text, "cachemgr_watch_gap_reads_total"),
            )

        tier = vllm.open(ns_dir, block_tokens=16, dtype="bfloat16", slots=64)["handle"]
        stall = dm.daemon.indexer.watcher.nest._lock
        try:
            with stall:  # the inotify thread waits at the first new dir it handles
                a, b = (
                    vllm.call("store", handle=tier, tokens=blocks(s, PROMPT), tag="a")["paths"]
                    for s in (1, 2)
                )
                got = vllm.call("load", handle=tier, tokens=blocks(1, PROMPT), tag="a", req="r1")
                assert got["loaded"] == got["correct"] == PROMPT
            wait_for(counted, lambda c: c == (PROMPT, 2 * PROMPT, PROMPT), timeout=60)
            vllm.call("store", handle=tier, tokens=blocks(3, PROMPT), tag="a")  # over the cap
            wait_for(lambda: len(on_disk(ns_dir)), lambda n: n <= 2 * PROMPT, timeout=60)
        finally:
            vllm.call("close", handle=tier)
    # B, never read, went whole; A, read, stayed. GC frees ahead of the writer at its measured
    # write rate (gc/runner.py `ahead`), so on a loaded host it may also take a page or two of
    # A after B's last. Were A's reads lost, A (the older prompt) would go first and B stay.
    assert sum(map(os.path.exists, b)) == 0
    assert sum(map(os.path.exists, a)) > PROMPT // 2
