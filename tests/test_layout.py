from __future__ import annotations

import os
from pathlib import Path

import pytest

from cachemgr.errors import ConfigError, UnsafePathError
from cachemgr.layout import FileKind, Layout, PageName, classify, parse_page_name
from tests.conftest import SglangDriver

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
        dict(model="ds", mla=True, tp_rank=1, tp_size=4, dcp_size=2, dcp_rank=1,
             logical_page_size=64),
    ]  # fmt: skip
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


def test_namespace_ids_cannot_name_paths(tmp_path: Path) -> None:
    lay = Layout.at(tmp_path)
    assert lay.ns_dir("0123456789abcdef") == tmp_path / "ns" / "0123456789abcdef"
    for bad in ["../../etc", "0123456789abcdef/..", "0123456789ABCDEF", "", "a" * 17]:
        with pytest.raises(UnsafePathError):
            lay.ns_dir(bad)


def test_root_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ConfigError, match="symlink"):
        Layout.at(tmp_path / "link")


def test_ensure_creates_skeleton_and_cachedir_tag(tmp_path: Path) -> None:
    lay = Layout.at(tmp_path / "r")
    lay.ensure()
    lay.ensure()
    assert (tmp_path / "r" / "ns").is_dir()
    assert (tmp_path / "r" / ".trash").is_dir()
    assert (tmp_path / "r" / ".cachemgr").is_dir()
    assert (tmp_path / "r" / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f59")


def test_unusable_root_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="cannot use root"):
        Layout.at(tmp_path / "file" / "root").ensure()
