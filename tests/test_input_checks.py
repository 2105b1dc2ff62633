"""Identity options are checked against the values SGLang's own parser accepts, before any
namespace is made or purged: a typo must not cost the good cache."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cachemgr.errors import ConfigError
from cachemgr.sglang.args import resolve_launch_args
from cachemgr.sglang.flags import CHOICES, INTEGER
from tests.nsfixtures import cli, one_line_error, snapshot
from tests.test_identity import make_model
from tests.test_init import CMD, NO_STORAGE_ENV, fill, init_json

KV_CHOICES = "auto, fp8_e5m2, fp8_e4m3, mxfp8, bf16, bfloat16, nvfp4, fp4_mx_block16"


def test_the_table_holds_sglangs_choices_for_identity_fields() -> None:
    assert CHOICES["kv_cache_dtype"] == tuple(KV_CHOICES.split(", "))
    assert "bfloat16" in CHOICES["dtype"] and "page_first" in CHOICES["hicache_mem_layout"]
    assert {"page_size", "tp_size", "pp_size"} <= INTEGER


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            "--kv-cache-dtype fp9_bogus",
            f"invalid --kv-cache-dtype 'fp9_bogus': SGLang 0.5.23 accepts {KV_CHOICES}",
        ),
        (
            "--dtype bf17",
            "invalid --dtype 'bf17': SGLang 0.5.23 accepts auto, half, float16, "
            "bfloat16, float, float32",
        ),
        ("--page-size 64.0", "invalid --page-size '64.0': SGLang 0.5.23 takes an integer"),
        ("--tp-size two", "invalid --tp-size 'two': SGLang 0.5.23 takes an integer"),
        (
            "--hicache-mem-layout page_last",
            "invalid --hicache-mem-layout 'page_last': SGLang "
            "0.5.23 accepts layer_first, page_first, page_first_direct, page_first_kv_split, "
            "page_head",
        ),
    ],
)
def test_a_value_sglang_refuses_is_refused(flags: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        resolve_launch_args(f"sglang serve --model-path m {flags}")
    assert str(e.value) == message


def test_values_sglang_accepts_pass() -> None:
    args = resolve_launch_args(
        "sglang serve --model-path m --kv-cache-dtype fp8_e4m3 --dtype bfloat16 --page-size 64 "
        "--quantization unquant --tp-size 2"
    )
    assert (args.kv_cache_dtype, args.page_size, args.quantization) == ("fp8_e4m3", 64, None)


@pytest.mark.parametrize("command", ["init", "exec", "doctor", "fingerprint"])
def test_a_bogus_kv_dtype_touches_nothing(root: Path, tmp_path: Path, command: str) -> None:
    """The bf16 namespace and its pages survive a launch SGLang itself would reject."""
    model = make_model(tmp_path / "model")
    first = init_json(root, model)
    fill(Path(str(first["storage_dir"])), 4)
    before = snapshot(root)
    # exec checks its program exists first: one that does, which must never run.
    program = [sys.executable, "-m", "sglang.launch_server", *CMD.split()[2:]]
    launch = [*program, "--model-path", str(model), "--kv-cache-dtype", "fp9_bogus"]
    out = cli("--root", str(root), command, "--", *launch, env=NO_STORAGE_ENV)
    assert one_line_error(out) == (
        f"cachemgr: error: invalid --kv-cache-dtype 'fp9_bogus': SGLang 0.5.23 accepts {KV_CHOICES}"
    )
    assert out.returncode == 2
    assert snapshot(root) == before
