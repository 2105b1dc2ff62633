"""SGLang's HiCacheFile names as cachemgr's file format reads them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cachemgr.backends import FileKind
from cachemgr.sglang.hicache import HICACHE_FILE, POOLS, PageName, parse_page_name
from tests.conftest import SglangDriver

classify = HICACHE_FILE.classify


def page_key(name: str) -> str | None:
    """The page a file belongs to, as the index and GC take it (a prefix of the name)."""
    n = HICACHE_FILE.key_len(name)
    return None if n is None else name[:n]


KEY = "fea7b32778ecbdd7adee1941e98c89cf96bbc762f5f1beb0be24e36a456fbbc5"


@pytest.mark.parametrize(
    "name",
    [
        f"{KEY}_Qwen-Qwen3-8B_0_1.bin",
        f"{KEY}_DeepSeek-V3.bin",  # MLA: one file per page shared by all TP ranks
        f"{KEY}_m_3_8_2_1.bin",  # TP 3/8, PP size 2 rank 1
        f"{KEY}_m_0_2_cp1_4.bin",
        f"{KEY}.mamba_Qwen3.8-27B_0_1.bin",
        f"{KEY}.auxiliary_swa_model_name_with_underscores_1_2.bin",
        f"{KEY}_ds_tp8_dcp1_2_page64.bin",
    ],
)
def test_page_names_round_trip(name: str) -> None:
    parsed = parse_page_name(name)
    assert parsed is not None
    assert str(parsed) == name
    assert classify(name) is FileKind.PAGE


def test_parser_reads_the_parts() -> None:
    assert parse_page_name(f"{KEY}.mamba_Qwen3.8-27B_1_2_2_0.bin") == PageName(
        key=KEY, pool="mamba", model="Qwen3.8-27B", tp_rank=1, tp_size=2, pp_size=2, pp_rank=0
    )


@pytest.mark.parametrize(
    "name",
    [
        "notes.txt",
        "CACHEDIR.TAG",
        f"{KEY}.bin",  # no model suffix: SGLang never writes this
        f"{KEY}_m_0_1.bin.bak",
        f"XYZ{KEY}_m_0_1.bin",
        f"{KEY}.unknownpool_m_0_1.bin",
        ".abc.tmp",  # temp names are a uuid4 hex
        f".{'0' * 32}.tmp.swp",
        "..",
    ],
)
def test_foreign_names_are_never_pages_or_temps(name: str) -> None:
    assert classify(name) is FileKind.FOREIGN


def test_temp_name() -> None:
    assert classify(f".{'a1' * 16}.tmp") is FileKind.TEMP


@pytest.mark.sglang
def test_parser_round_trips_names_written_by_sglang(sglang: SglangDriver, tmp_path: Path) -> None:
    configs = [
        dict(model="Qwen/Qwen3-8B"),
        dict(model="org/Model_With_Underscores", tp_rank=3, tp_size=8),
        dict(model="deepseek-ai/DeepSeek-V3", mla=True),
        dict(model="m", tp_rank=1, tp_size=2, pp_rank=1, pp_size=2),
        dict(model="m", cp_rank=1, cp_size=2),
        dict(
            model="ds", mla=True, tp_rank=1, tp_size=4, dcp_size=2, dcp_rank=1, logical_page_size=64
        ),
    ]
    for i, cfg in enumerate(configs):
        d = tmp_path / f"s{i}"
        d.mkdir()  # only TP rank 0 creates the directory
        h = sglang.open(d, **cfg)
        out = sglang.write(h, [[i, 128]])
        assert out["stored"] == 2
        sglang.write(h, [[i, 128]], pool="mamba")
        names = os.listdir(d)
        assert len(names) == 4
        for name in names:
            parsed = parse_page_name(name)
            assert parsed is not None, name
            assert str(parsed) == name
            assert parsed.key in out["keys"]
            assert parsed.model == cfg["model"].replace("/", "-")


def test_every_file_of_a_page_has_its_key() -> None:
    """Pools and ranks of one page share the key; nothing else does (a longer key, a temp)."""
    files = [
        f"{KEY}_m_0_2.bin",
        f"{KEY}_m_1_2.bin",
        f"{KEY}.mamba_m_0_2.bin",
        f"{KEY}.deepseek_v4_c4_indexer_state_m_3_8_2_1_cp0_2.bin",
        f"{KEY}_DeepSeek-V3.bin",
    ]
    assert {page_key(n) for n in files} == {KEY}
    assert page_key(f"{KEY}0_m_0_2.bin") == KEY + "0"
    assert page_key(f".{'a' * 32}.tmp") is None
    assert page_key("notes.bin") is None


def test_the_longest_pool_name_is_the_one_read() -> None:
    name = f"{KEY}.deepseek_v4_c4_indexer_state_m_0_1.bin"
    parsed = parse_page_name(name)
    assert parsed is not None and (parsed.pool, parsed.model) == (
        "deepseek_v4_c4_indexer_state",
        "m",
    )


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        (f".{'a1' * 16}.tmp", FileKind.TEMP),  # 0.5.23
        (f"{KEY}_m_0_1.bin.tmp.4242.140213.{'c' * 32}", FileKind.TEMP),  # another revision
        (f"{KEY}.mamba_m_0_1.bin.tmp.1.2.{'c' * 32}", FileKind.TEMP),
        (f"{KEY}_m_0_1.bin.tmp.4242.{'c' * 32}", FileKind.FOREIGN),
        (f"{KEY}_m_0_1.bin.tmp.1.2.{'c' * 31}", FileKind.FOREIGN),
        (f"notes.bin.tmp.1.2.{'c' * 32}", FileKind.FOREIGN),
    ],
)
def test_temp_names(name: str, kind: FileKind) -> None:
    assert classify(name) is kind
    assert HICACHE_FILE.maybe_temp(name)  # the cheap filter never hides a temp


@pytest.mark.sglang
def test_pools_are_sglangs(sglang: SglangDriver) -> None:
    """Every extra memory pool SGLang has is a pool name here (its KV pool has no part)."""
    assert set(POOLS) == set(sglang.call("pools")["names"]) - {"kv"}


@pytest.mark.sglang
def test_pool_and_rank_files_sglang_writes_share_their_pages_key(
    sglang: SglangDriver, tmp_path: Path
) -> None:
    d = tmp_path / "s"
    d.mkdir()
    keys: set[str] = set()
    for rank in (0, 1):
        h = sglang.open(d, model="org/M", tp_rank=rank, tp_size=2)
        keys |= set(sglang.write(h, [[7, 192]])["keys"])
        sglang.write(h, [[7, 192]], pool="mamba")
        sglang.write(h, [[7, 192]], pool="deepseek_v4_c4_indexer")
    names = os.listdir(d)
    assert len(keys) == 3 and len(names) == 3 * 2 * 3  # pages x ranks x (KV + 2 pools)
    assert {page_key(n) for n in names} == keys
