"""End to end with SGLang's own HiCacheFile: init keeps one identity's pages from another.

Identity A is a bf16 KV server, identity B the same model path with fp8_e4m3 KV. SGLang's page
keys are the same for both (token hashes + model name), so without cachemgr B "hits" A's pages
and gets A's bytes back (FIELD_NOTES §5); with `cachemgr init`, B starts in its own namespace.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import SglangDriver
from tests.nsfixtures import cli
from tests.test_identity import make_model

pytestmark = pytest.mark.sglang

PROMPT = [[11, 640]]  # 10 pages of 64 tokens
PAGES = 10
LAUNCH = "sglang serve --enable-hierarchical-cache --hicache-storage-backend file --page-size 64"


def init(root: Path, model: Path, kv: str, *extra: str) -> dict[str, object]:
    """`cachemgr init --json … -- <launch command with --kv-cache-dtype kv>`."""
    launch = [*LAUNCH.split(), "--model-path", str(model), "--kv-cache-dtype", kv]
    out = cli(
        "--root",
        str(root),
        "init",
        "--json",
        *extra,
        "--",
        *launch,
        env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": ""},
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    return result


def serve(sglang: SglangDriver, storage_dir: object, model: Path) -> int:
    """A server's TP rank 0 opening its file backend on `storage_dir`."""
    return sglang.open(Path(str(storage_dir)), model=str(model))


def test_reference_hazard_without_cachemgr(sglang: SglangDriver, tmp_path: Path) -> None:
    """Same directory reused across a KV dtype change: B is served A's bytes, silently."""
    shared = tmp_path / "hicache"
    a = sglang.open(shared, model="m")
    assert sglang.write(a, PROMPT, dtype="bfloat16", tag="A")["stored"] == PAGES
    b = sglang.open(shared, model="m")
    got = sglang.read(b, PROMPT, dtype="fp8_e4m3", tag="B")
    assert got["hit_pages"] == PAGES  # every page looks like a hit …
    assert got["wrong"] == PAGES and got["correct"] == 0  # … and every one is A's bytes
    assert got["errors"] == []  # no error to notice


def test_init_purges_a_on_change_and_b_reads_only_its_own_bytes(
    sglang: SglangDriver, tmp_path: Path
) -> None:
    model = make_model(tmp_path / "model")
    root = tmp_path / "root"
    first = init(root, model, "bfloat16")
    a = serve(sglang, first["storage_dir"], model)
    assert sglang.write(a, PROMPT, dtype="bfloat16", tag="A")["stored"] == PAGES
    second = init(root, model, "fp8_e4m3")
    assert second["ns_id"] != first["ns_id"]
    assert (second["old_action"], second["old_pages"]) == ("purged", PAGES)
    assert second["changes"] == ["kv_cache_dtype: bfloat16 → fp8_e4m3"]
    assert not Path(str(first["storage_dir"])).exists()
    b = serve(sglang, second["storage_dir"], model)
    cold = sglang.read(b, PROMPT, dtype="fp8_e4m3", tag="B")
    assert (cold["hit_pages"], cold["read"], cold["errors"]) == (0, 0, [])
    assert sglang.write(b, PROMPT, dtype="fp8_e4m3", tag="B")["stored"] == PAGES
    warm = sglang.read(b, PROMPT, dtype="fp8_e4m3", tag="B")
    assert (warm["hit_pages"], warm["correct"], warm["wrong"], warm["errors"]) == (
        PAGES,
        PAGES,
        0,
        [],
    )


def test_two_instances_on_one_root_stay_separate(sglang: SglangDriver, tmp_path: Path) -> None:
    model = make_model(tmp_path / "model")
    root = tmp_path / "root"
    one = init(root, model, "bfloat16", "--instance", "one")
    two = init(root, model, "fp8_e4m3", "--instance", "two")
    a = serve(sglang, one["storage_dir"], model)
    b = serve(sglang, two["storage_dir"], model)
    sglang.write(a, PROMPT, dtype="bfloat16", tag="A")
    assert sglang.read(b, PROMPT, dtype="fp8_e4m3", tag="B")["hit_pages"] == 0
    sglang.write(b, PROMPT, dtype="fp8_e4m3", tag="B")
    # Purging two's namespace leaves one's pages readable and correct.
    assert cli("--root", str(root), "purge", "--instance", "two", "--yes").returncode == 0
    back = sglang.read(a, PROMPT, dtype="bfloat16", tag="A")
    assert (back["hit_pages"], back["correct"], back["wrong"]) == (PAGES, PAGES, 0)
    assert sglang.read(b, PROMPT, dtype="fp8_e4m3", tag="B")["hit_pages"] == 0
