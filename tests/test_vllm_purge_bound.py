"""A purge of a bound vLLM namespace while vLLM's own fs tier (tests/vllm_driver.py) keeps
running: vLLM writes its folder's config.json only at start and only if absent, so the purge
must put it back, or the tier's later blocks are never vouched for (never indexed, never
evicted: issue 26, point 7)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import VllmDriver
from tests.daemon_helpers import running_daemon
from tests.polling import wait_for
from tests.test_server import metric
from tests.test_vllm_daemon import BLOCK, NS, blocks, on_disk, settings, vllm_root

pytestmark = pytest.mark.vllm


def test_a_purge_while_bound_keeps_the_tier_vouched_and_under_its_cap(
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
        gc_min_age=0,
    )
    with running_daemon(cfg) as dm:
        opened = vllm.open(ns_dir, block_tokens=16, dtype="bfloat16", slots=64)
        tier, config = opened["handle"], Path(opened["config_path"])
        identity = config.read_bytes()
        try:
            vllm.call("store", handle=tier, tokens=blocks(1, 8), tag="a")

            def pages() -> float | None:
                return metric(dm.get("/metrics").text, "cachemgr_namespace_pages", namespace=NS)

            wait_for(pages, lambda n: n == 8, timeout=30, what="the first stores indexed")
            r = dm.post("/v1/purge", json={"namespace": NS})
            assert r.status_code == 200, r.text
            assert r.json()["purged"][0]["recreated"] is True
            assert on_disk(ns_dir) == []
            assert config.read_bytes() == identity  # the same bytes vLLM wrote, in place
            for s in range(2, 12):  # the same tier object: it will not write config.json again
                assert vllm.call("store", handle=tier, tokens=blocks(s, 8), tag="a")["failed"] == 0
            wait_for(
                lambda: len(on_disk(ns_dir)),
                lambda n: n <= cap_blocks,
                timeout=60,
                what="the cap over the blocks stored after the purge",
            )
            wait_for(
                pages,
                lambda n: n == len(on_disk(ns_dir)),
                timeout=90,  # (beside four workers on two cores it took past 30 s, once)
                what="the index equal to the disk",
            )
            assert dm.namespaces()[NS]["pages"] > 0
        finally:
            vllm.call("close", handle=tier)
