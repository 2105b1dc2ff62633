"""The launch-command parser, on the operators' real commands (FIELD_NOTES §6) and edge cases."""

from __future__ import annotations

import ast
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import pytest

from cachemgr.errors import ConfigError
from cachemgr.sglang import flags as sglang_flags
from cachemgr.sglang.args import LaunchArgs, resolve_launch_args, scan_flags, split_command
from cachemgr.sglang.identity import _tp_lcm_size
from tests.conftest import REPO, SGLANG_ENV, ScriptRunner
from tests.test_identity import ident, make_model

# FIELD_NOTES §6, pasted as operators run them (continuation lines included).
RTX4090 = r"""sglang serve --model-path Qwen3.8-27B-W4A16-AWQ \
  --speculative-algorithm DFLASH \
  --speculative-draft-model-path Qwen3.8-27B-DFlash2-FP8 \
  --speculative-num-draft-tokens 8 \
  --kv-cache-dtype fp8_e4m3 --mem-fraction-static 0.75 \
  --context-length 131072 --max-running-requests 2 \
  --max-mamba-cache-size 14 --page-size 64 \
  --enable-hierarchical-cache --hicache-size 32 \
  --hicache-storage-backend file --disable-prefill-cuda-graph"""

# FIELD_NOTES' 5090 command has `--cuda-graph-max-bs`, which SGLang 0.5.23 refuses (an
# ambiguous prefix of its -decode/-prefill flags); here it is spelled as 0.5.23 takes it.
RTX5090 = r"""sglang serve --trust-remote-code \
  --model-path gittensor-model-hub/Qwen3.8-27B-NVFP4-RTX5090 \
  --served-model-name qwen3.8-27b --kv-cache-dtype fp8_e4m3 \
  --mem-fraction-static 0.90 --attention-backend flashinfer \
  --max-running-requests 1 --cuda-graph-max-bs-decode 1 \
  --reasoning-parser qwen3 --tool-call-parser qwen3_coder \
  --mamba-full-memory-ratio 5.61 --mamba-radix-cache-strategy extra_buffer_lazy \
  --mamba-ssm-dtype bfloat16 --speculative-algorithm DFLASH \
  --speculative-draft-model-path maurienne-ai/Qwen3.8-27B-DFlash2-NVFP4-RTNcal \
  --speculative-draft-model-quantization modelopt_fp4 \
  --speculative-num-draft-tokens 8 --chunked-prefill-size 1024 \
  --cuda-graph-bs-prefill 64 128 256 512 1024 --enable-memory-saver \
  --enable-hierarchical-cache --hicache-ratio 2 \
  --hicache-write-policy write_through --host 0.0.0.0 --port 30000"""


def to_equals_style(command: str) -> list[str]:
    """The same command with every single-valued `--flag value` written `--flag=value`."""
    tokens = split_command(command)
    out: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        multi = tok in sglang_flags.MULTI_VALUE
        if tok.startswith("--") and nxt is not None and not nxt.startswith("--") and not multi:
            out.append(f"{tok}={nxt}")
            i += 2
        else:
            out.append(tok)
            i += 1
    return out


def test_rtx4090_command() -> None:
    args = resolve_launch_args(RTX4090)
    assert args.model_path == "Qwen3.8-27B-W4A16-AWQ"
    assert args.speculative_algorithm == "DFLASH"
    assert args.speculative_draft_model_path == "Qwen3.8-27B-DFlash2-FP8"
    assert args.kv_cache_dtype == "fp8_e4m3"
    assert args.page_size == 64
    assert args.enable_hierarchical_cache is True
    assert args.hicache_storage_backend == "file"
    assert args.served_model_name is None
    assert args.model_name == "Qwen3.8-27B-W4A16-AWQ"
    assert (args.host, args.port) == ("127.0.0.1", 30000)  # SGLang's defaults
    assert args.hicache_mem_layout == "page_first"
    assert args.mamba_track_interval == 256


def test_rtx5090_command_with_multi_value_flag() -> None:
    args = resolve_launch_args(RTX5090)
    assert args.model_path == "gittensor-model-hub/Qwen3.8-27B-NVFP4-RTX5090"
    assert args.served_model_name == "qwen3.8-27b"
    assert args.model_name == "qwen3.8-27b"
    assert args.kv_cache_dtype == "fp8_e4m3"
    assert args.mamba_ssm_dtype == "bfloat16"
    assert args.speculative_draft_model_path == "maurienne-ai/Qwen3.8-27B-DFlash2-NVFP4-RTNcal"
    assert args.speculative_draft_model_quantization == "modelopt_fp4"
    # `--cuda-graph-bs-prefill 64 128 …` must not leak into anything, and the switch after it
    # must still be seen as a switch.
    assert args.page_size == 1  # absent: SGLang resolves None to 1
    assert args.enable_hierarchical_cache is True
    assert (args.host, args.port) == ("0.0.0.0", 30000)


@pytest.mark.parametrize("command", [RTX4090, RTX5090])
def test_both_flag_styles_agree(command: str) -> None:
    equals = to_equals_style(command)
    assert any("=" in tok for tok in equals)
    assert resolve_launch_args(equals) == resolve_launch_args(command)


@pytest.mark.parametrize(
    "prefix",
    [
        ["sglang", "serve"],
        ["python", "-m", "sglang.launch_server"],
        ["python3", "-m", "sglang.launch_server"],
        ["env", "CUDA_VISIBLE_DEVICES=0", "python3.11", "-u", "-m", "sglang.launch_server"],
        [],
    ],
)
def test_program_prefixes(prefix: list[str]) -> None:
    args = resolve_launch_args([*prefix, "--model-path", "/m", "--tp-size", "2"])
    assert (args.model_path, args.tp_size) == ("/m", 2)


def test_aliases() -> None:
    args = resolve_launch_args(
        "sglang serve --model /m --tensor-parallel-size 4 --pipeline-parallel-size 2 "
        "--enable-hicache --speculative-draft-model /d --decode-context-parallel-size 2 "
        "--attention-context-parallel-size 2"
    )
    assert args.model_path == "/m"
    assert (args.tp_size, args.pp_size, args.dcp_size, args.attn_cp_size) == (4, 2, 2, 2)
    assert args.enable_hierarchical_cache is True
    assert args.speculative_draft_model_path == "/d"


def test_other_flags_are_skipped_with_their_values() -> None:
    # Flags SGLang knows and cachemgr does not read; one SGLang does not know is refused
    # (tests/test_launch_abbrev.py).
    args = resolve_launch_args(
        "sglang serve --disable-cuda-graph --model-path /m --cuda-graph-bs-prefill 1 2 3 "
        "--page-size 32 --mem-fraction-static 0.8 --kv-cache-dtype bf16 --enable-metrics"
    )
    assert (args.model_path, args.page_size, args.kv_cache_dtype) == ("/m", 32, "bf16")


def test_known_switch_does_not_take_the_next_token() -> None:
    # A switch followed by a word: the word is not the switch's value; SGLang refuses it
    # (tests/test_launch_positionals.py), and so does cachemgr.
    with pytest.raises(ConfigError, match="unrecognized argument 'stray'"):
        scan_flags(["--enable-hierarchical-cache", "stray", "--page-size", "16"])
    found = scan_flags(["--enable-hierarchical-cache", "--page-size", "16"])
    assert found == {"enable_hierarchical_cache": True, "page_size": "16"}


def test_last_occurrence_wins_like_argparse() -> None:
    args = resolve_launch_args("--model-path /a --page-size 16 --model-path /b --page-size=64")
    assert (args.model_path, args.page_size) == ("/b", 64)


def test_explicit_values_override_the_command() -> None:
    args = resolve_launch_args(
        "sglang serve --model-path /a --kv-cache-dtype bf16",
        {"kv_cache_dtype": "fp8_e4m3", "page_size": 64, "tp_size": None},
    )
    assert (args.model_path, args.kv_cache_dtype, args.page_size, args.tp_size) == (
        "/a",
        "fp8_e4m3",
        64,
        1,
    )


def test_explicit_values_alone() -> None:
    assert resolve_launch_args((), {"model_path": "/m"}).model_path == "/m"


def test_missing_model_path_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="no model path: pass --model-path"):
        resolve_launch_args("sglang serve --kv-cache-dtype fp8_e4m3 --page-size 64")


@pytest.mark.parametrize(
    ("command", "needle"),
    [
        ("--model-path /m --page-size", "--page-size needs a value"),
        ("--model-path /m --page-size sixty-four", "invalid --page-size 'sixty-four'"),
        ("--model-path /m --tp-size 0", "invalid --tp-size"),
        ("--model-path /m --enable-hierarchical-cache=yes", "takes no value"),
        ("--config serve.yaml", "cannot read SGLang config files"),
    ],
)
def test_bad_values_are_config_errors(command: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        resolve_launch_args(command)


def test_deprecated_dp_attention_becomes_attention_dp() -> None:
    args = resolve_launch_args("--model-path /m --tp-size 4 --dp-size 4 --enable-dp-attention")
    assert (args.attn_dp_size, args.dp_size) == (4, 1)


def test_dwdp_makes_every_tp_rank_an_attention_dp_group(tmp_path: Path) -> None:
    """parallel_hook.py `handle_dwdp` sets attn_dp_size to the DWDP size: each rank then
    writes all KV heads under attention-TP rank 0 of 1, not its 1/tp share under its TP
    rank. Read as plain TP, a DWDP server shared the TP server's namespace."""
    model = make_model(tmp_path / "model")
    dwdp = ident(f"--model-path {model} --tp-size 4 --dwdp-size 4")
    assert dwdp.topology == ident(f"--model-path {model} --tp-size 4 --attn-dp-size 4").topology
    assert dwdp.ns_id != ident(f"--model-path {model} --tp-size 4").ns_id
    # SGLang ignores a DWDP size up to 1
    assert (
        ident(f"--model-path {model} --dwdp-size 1").ns_id == ident(f"--model-path {model}").ns_id
    )
    args = resolve_launch_args("--model-path /m --tp-size 2 --dp-size 2 --dwdp-size 2")
    assert (args.attn_dp_size, args.dp_size) == (2, 1)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ("--tp-size 4 --dwdp-size 2", r"set --tp-size 2 \(equal to --dwdp-size\) or drop"),
        ("--tp-size 2 --pp-size 2 --dwdp-size 2", "use --pp-size 1 or drop --dwdp-size"),
        (
            "--tp-size 2 --dwdp-size 2 --disaggregation-mode decode",
            "use --disaggregation-mode null or prefill, or drop",
        ),
        ("--tp-size 2 --dwdp-size 2 --speculative-algorithm EAGLE", "drop --speculative-algo"),
        ("--tp 4 --dwdp-size 4 --enable-eplb", "drop --enable-eplb or --dwdp-size"),
        ("--tp 2 --dwdp-size 2 --enable-two-batch-overlap", "drop --enable-two-batch-overlap"),
        # the first of handle_dwdp's assertions to fail is the one said
        ("--tp 2 --pp-size 2 --dwdp-size 2 --enable-eplb", "drop --enable-eplb"),
    ],
)
def test_a_dwdp_launch_sglang_refuses_is_refused(flags: str, needle: str) -> None:
    """handle_dwdp's assertions stop the server at start: refused before init purges."""
    with pytest.raises(ConfigError, match=f"^--dwdp-size [24]: SGLang [^;]* refuses it; {needle}"):
        resolve_launch_args(f"sglang serve --model-path /m {flags}")
    # without DWDP SGLang takes them
    resolve_launch_args(f"sglang serve --model-path /m {flags.replace('--dwdp-size', '--dp')}")


def test_direct_io_turns_page_first_into_page_first_direct() -> None:
    args = resolve_launch_args(
        "--model-path /m --enable-hierarchical-cache --hicache-io-backend direct"
    )
    assert args.hicache_mem_layout == "page_first_direct"


def test_a_pd_decode_server_offloading_with_direct_io_writes_page_first_direct() -> None:
    """Its host pool is built with the resolved layout (hicache_hook.py `handle_hicache` runs
    for decode offload too): recorded as page_first, it shared a prefill server's namespace
    while its pages' bytes were in another order."""
    args = resolve_launch_args(
        "--model-path /m --disaggregation-mode decode"
        " --disaggregation-decode-enable-offload-kvcache --hicache-io-backend direct"
    )
    assert args.hicache_mem_layout == "page_first_direct"


def test_unified_memory_takes_direct_io_back_to_page_first() -> None:
    """`resolve_unified_memory_layout_io`: the same pages as unified memory without direct I/O."""
    args = resolve_launch_args(
        "--model-path /m --enable-hierarchical-cache --enable-unified-memory"
        " --hicache-io-backend direct"
    )
    plain = resolve_launch_args(
        "--model-path /m --enable-hierarchical-cache --enable-unified-memory"
    )
    assert args.hicache_mem_layout == plain.hicache_mem_layout == "page_first"


def test_a_server_writing_no_page_keeps_its_layout_as_given() -> None:
    args = resolve_launch_args("--model-path /m --hicache-io-backend direct")
    assert args.hicache_mem_layout == "page_first"


def test_draft_quantization_inherits_unless_set() -> None:
    inherit = resolve_launch_args("--model-path /m --quantization awq --speculative-draft-model /d")
    assert inherit.speculative_draft_model_quantization == "awq"
    own = resolve_launch_args(
        "--model-path /m --quantization awq --speculative-draft-model-quantization unquant"
    )
    assert (own.quantization, own.speculative_draft_model_quantization) == ("awq", None)


def test_launch_args_are_frozen() -> None:
    args = resolve_launch_args("--model-path /m")
    with pytest.raises(ValueError, match="frozen"):
        args.page_size = 64  # type: ignore[misc]
    assert isinstance(args, LaunchArgs)


# SGLang's own parser, run in the SGLang env: our reading of the operators' commands must
# match argparse's, and the committed flag table must match the installed SGLang.
_SGLANG_PARSE = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
p = argparse.ArgumentParser()
ServerArgs.add_cli_args(p)
ns = p.parse_args(json.loads(sys.argv[1]))
scalar = (str, int, bool, type(None))
print(json.dumps({k: v for k, v in vars(ns).items() if isinstance(v, scalar)}))
"""


@pytest.mark.sglang
@pytest.mark.parametrize("command", [RTX4090, RTX5090])
def test_matches_sglangs_own_argparse(command: str, sglang_scripts: ScriptRunner) -> None:
    argv = split_command(command)[2:]  # after `sglang serve`
    theirs = json.loads(sglang_scripts.run(_SGLANG_PARSE, argv=[json.dumps(argv)]))
    ours = resolve_launch_args(command).model_dump()
    # Fields SGLang resolves later, after argparse: page_size None → 1 and the draft
    # quantization inheriting the target's; page_size_source and launch_env (the `VAR=…`
    # prefix before the program) are ours alone.
    assert theirs["page_size"] in (None, ours["page_size"])
    derived = {
        "page_size",
        "page_size_source",
        "speculative_draft_model_quantization",
        "launch_env",
    }
    for field in set(ours) - derived:
        assert ours[field] == theirs[field], field


@pytest.mark.sglang
def test_flag_table_is_current(sglang_scripts: ScriptRunner) -> None:
    out = sglang_scripts.run(path=REPO / "scripts" / "gen_sglang_flags.py")
    committed = (REPO / "cachemgr" / "sglang" / "flags.py").read_text()
    assert out.strip() == committed.strip()


@pytest.mark.parametrize(
    ("flags", "page", "source"),
    [
        ("", None, "default"),  # SGLang picks it on the GPU (trtllm_mha → 64 on SM100)
        ("--page-size 16", 16, "flag"),
        ("--attention-backend flashmla", 64, "attention_backend"),
        ("--page-size 1 --decode-attention-backend flashmla", 64, "attention_backend"),
        ("--attention-backend trtllm_mla --page-size 32", 32, "flag"),
        ("--attention-backend trtllm_mla --page-size 128", 64, "attention_backend"),
        ("--prefill-attention-backend cutedsl_mla", 64, "attention_backend"),
        ("--attention-backend trtllm_mha --page-size 128", 128, "flag"),
        ("--speculative-draft-attention-backend trtllm_mha", 64, "attention_backend"),
        ("--attention-backend hpc_ops --page-size 128", 64, "attention_backend"),
        ("--attention-backend fa3", None, "default"),
        # serving_hook.py renames the deprecated names before any backend forces a page size
        ("--attention-backend tokenspeed_mla", 64, "attention_backend"),
        ("--decode-attention-backend tokenspeed_mla --page-size 32", 32, "flag"),
        ("--prefill-attention-backend tokenspeed_mla", None, "default"),  # → trtllm_mla
        ("--attention-backend compressed", None, "default"),
    ],
)
def test_page_size_resolution(flags: str, page: int | None, source: str) -> None:
    args = resolve_launch_args(f"sglang serve --model-path m {flags}")
    assert (args.resolved_page_size, args.page_size_source) == (page, source)


@pytest.mark.parametrize(
    ("flags", "backends", "kv"),
    [
        ("--attention-backend tokenspeed_mla", ("cutedsl_mla", None), "fp8_e4m3"),
        (
            "--decode-attention-backend tokenspeed_mla --kv-cache-dtype bf16",
            (None, None),
            "fp8_e4m3",
        ),
        # cutedsl_mla is decode-only: a renamed prefill backend becomes trtllm_mla, no FP8 forced
        ("--prefill-attention-backend tokenspeed_mla", (None, "trtllm_mla"), "auto"),
        ("--prefill-attention-backend cutedsl_mla", (None, "cutedsl_mla"), "auto"),
        ("--attention-backend compressed --kv-cache-dtype bf16", ("dsv4", None), "bf16"),
    ],
)
def test_deprecated_backends_are_read_as_sglang_renames_them(
    flags: str, backends: tuple[str | None, str | None], kv: str
) -> None:
    args = resolve_launch_args(f"sglang serve --model-path m {flags}")
    assert (args.attention_backend, args.prefill_attention_backend) == backends
    assert args.kv_cache_dtype == kv


def test_tokenspeed_mla_shares_the_namespace_of_what_it_means(tmp_path: Path) -> None:
    """SGLang runs tokenspeed_mla as cutedsl_mla with an FP8 KV cache: not bf16 pages."""
    m = make_model(tmp_path / "m")
    renamed = ident(f"--model-path {m} --attention-backend tokenspeed_mla")
    assert (renamed.kv_cache_dtype, renamed.page_size) == ("fp8_e4m3", 64)
    meant = ident(f"--model-path {m} --attention-backend cutedsl_mla --kv-cache-dtype fp8_e4m3")
    assert renamed.ns_id == meant.ns_id
    assert renamed.ns_id != ident(f"--model-path {m}").ns_id


def test_explicit_page_size_option_counts_as_a_flag() -> None:
    args = resolve_launch_args("sglang serve --model-path m", {"page_size": 64})
    assert (args.resolved_page_size, args.page_size_source) == (64, "flag")


@pytest.mark.parametrize("value", ["{not json", "[1, 2]", '"a string"', "null"])
def test_extra_config_that_is_not_a_json_object_is_refused_when_resolved(value: str) -> None:
    # SGLang would fail on it at start; read as {} it would hide a file_storage_path.
    with pytest.raises(ConfigError, match="--hicache-storage-backend-extra-config is not a JSON"):
        resolve_launch_args(["--model-path", "/m", "--hicache-storage-backend-extra-config", value])


def test_extra_config_is_parsed_once_for_every_reader() -> None:
    args = resolve_launch_args(
        ["--model-path", "/m", "--hicache-storage-backend-extra-config", '{"tp_lcm_size": 4}']
    )
    assert args.extra_config == {"tp_lcm_size": 4}
    assert resolve_launch_args(["--model-path", "/m"]).extra_config == {}


def sglang_extra_config_parser() -> Callable[[str], tuple[Any, ...]]:
    """SGLang's own reader of an extra config (its cache controller's static method), taken
    from its source: the module's imports need a GPU build."""
    (path,) = SGLANG_ENV.glob(
        "lib/python*/site-packages/sglang/srt/mem_cache/hybrid_cache/hybrid_cache_controller.py"
    )
    tree = ast.parse(path.read_text())
    (fn,) = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == "parse_storage_backend_extra_config"
    ]
    fn.decorator_list = []
    namespace: dict[str, Any] = {"os": os, "json": json, "Optional": Optional}
    exec(compile(ast.Module([fn], []), str(path), "exec"), namespace)
    parse: Callable[[str], tuple[Any, ...]] = namespace[fn.name]
    return parse


@pytest.mark.sglang
@pytest.mark.parametrize("ext", ["json", "toml", "yaml", "yml"])
def test_an_extra_config_file_reads_as_sglang_reads_it(tmp_path: Path, ext: str) -> None:
    wanted = {"file_storage_path": "/srv/l3", "max_size": 1 << 30, "tp_lcm_size": 4}
    path = tmp_path / f"extra.{ext}"
    sep = " =" if ext == "toml" else ":"
    lines = [f"{k}{sep} {json.dumps(v)}" for k, v in wanted.items()]
    path.write_text(json.dumps(wanted) if ext == "json" else "\n".join(lines) + "\n")
    argv = ["--model-path", "/m", "--hicache-storage-backend-extra-config", f"@{path}"]
    assert resolve_launch_args(argv).extra_config == wanted
    assert sglang_extra_config_parser()(f"@{path}")[0] == wanted  # (what its backend gets)


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("extra.txt", "{}", "SGLang reads a .json, .toml, .yaml or .yml file only"),
        ("absent.json", None, "No such file or directory"),
        ("extra.toml", "a = [", "not a valid toml file"),
        ("extra.yaml", "- a list", "is not a JSON object"),
    ],
)
def test_an_extra_config_file_sglang_would_fail_on_is_refused(
    tmp_path: Path, name: str, content: str | None, says: str
) -> None:
    if content is not None:
        (tmp_path / name).write_text(content)
    argv = ["--model-path", "/m", "--hicache-storage-backend-extra-config", f"@{tmp_path / name}"]
    with pytest.raises(ConfigError, match=says):
        resolve_launch_args(argv)


def test_the_file_storage_path_flag_is_the_extra_configs_default_with_hierarchical_cache() -> None:
    base = "sglang serve --model-path m --hicache-storage-backend file --file-storage-path /f"
    assert resolve_launch_args(base).extra_config == {}  # (no hierarchical cache: not read)
    hicache = resolve_launch_args(f"{base} --enable-hierarchical-cache")
    assert hicache.extra_config == {"file_storage_path": "/f"}
    extra = """ --hicache-storage-backend-extra-config '{"file_storage_path": "/e"}'"""
    assert resolve_launch_args(f"{base} --enable-hierarchical-cache{extra}").extra_config == {
        "file_storage_path": "/e"
    }


@pytest.mark.parametrize(("value", "kept"), [("false", 0), ("true", 1), ('""', None), ("[]", None)])
def test_a_tp_lcm_size_sglang_skips_or_runs_is_read_not_refused(value: str, kept: object) -> None:
    """`if tp_lcm_size:` skips a falsy one; `true % 1 == 0`: the ids false and true had stay."""
    extra = f'{{"tp_lcm_size": {value}}}'
    args = resolve_launch_args(
        ["--model-path", "/m", "--hicache-storage-backend-extra-config", extra]
    )
    assert _tp_lcm_size(args) == kept
