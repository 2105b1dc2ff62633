"""The fleet test bed itself: each bindfs node's inotify sees only the accesses made through it
(what makes the fleet tests mean anything), and etcd serves its v3 gateway."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.fleet_bed import (
    IN_CLOSE_NOWRITE,
    IN_CLOSE_WRITE,
    IN_DELETE,
    Inotify,
    bindfs_nodes,
    need_binaries,
    running_etcd,
)

pytestmark = pytest.mark.fleet


def test_inotify_on_a_node_sees_only_the_accesses_made_through_it(tmp_path: Path) -> None:
    need_binaries()
    mask = IN_CLOSE_WRITE | IN_CLOSE_NOWRITE | IN_DELETE
    with bindfs_nodes(tmp_path / "backing", tmp_path / "mnt", 2) as (a, b):
        on_a, on_b = Inotify(a, mask), Inotify(b, mask)
        try:
            (a / "page.bin").write_bytes(b"x" * 10)  # written through A
            assert (b / "page.bin").read_bytes() == b"x" * 10  # read through B
            seen_a, seen_b = on_a.read(), on_b.read()
            assert seen_a == [(IN_CLOSE_WRITE, "page.bin")]
            assert seen_b == [(IN_CLOSE_NOWRITE, "page.bin")]
            (b / "page.bin").unlink()  # deleted through B: A's watch hears nothing
            assert not (a / "page.bin").exists()
            assert on_a.read() == [] and on_b.read() == [(IN_DELETE, "page.bin")]
        finally:
            on_a.close()
            on_b.close()


def test_etcd_serves_the_v3_json_gateway(tmp_path: Path) -> None:
    need_binaries()
    with running_etcd(tmp_path) as etcd:
        r = httpx.post(f"http://{etcd.endpoint}/v3/kv/range", json={"key": "eA=="}, timeout=5)
        assert r.status_code == 200 and "header" in r.json()
