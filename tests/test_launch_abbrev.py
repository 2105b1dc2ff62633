"""Abbreviated flags read as the engines' own parsers read them (argparse's allow_abbrev).

Every prefix of every identity flag, in `--flag value` and `--flag=value` form (and vLLM's
short flags, attached and with `=`), goes through SGLang's parser in .sglang-env and vLLM's
in .vllm-env, and through cachemgr: where the engine refuses the token, cachemgr refuses it;
where the engine reads a value, cachemgr reads the same one."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cachemgr.argprefix import read_option
from cachemgr.errors import ConfigError
from cachemgr.sglang import args as sglang_args
from cachemgr.sglang import flags as sglang_flags
from cachemgr.vllm import args as vllm_args
from cachemgr.vllm import flags as vllm_flags
from tests.conftest import ScriptRunner

SGLANG_BOOLS = {
    "enable_dp_attention",
    "enable_hierarchical_cache",
    "trust_remote_code",
    "enable_page_major_kv_layout",
    "enable_unified_memory",
}
SGLANG_JSON = {"json_model_override_args", "hicache_storage_backend_extra_config"}
VLLM_VALUES = {
    "max_model_len": "32k",
    "hf_overrides": '{"a": 1}',
    "kv_transfer_config": json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}),
}


def _value(field: str, choices: dict[str, tuple[str, ...]], integer: frozenset[str]) -> str:
    """A value the engine takes for `field` and that is not its default."""
    if field in choices:
        return choices[field][-1]
    if field in integer or field.endswith("_size"):
        return "2"
    return VLLM_VALUES.get(field, '{"a": 1}' if field in SGLANG_JSON else "/some/value")


def _cases(flags: dict[str, str], value_of: Callable[[str], str | None]) -> list[dict[str, Any]]:
    """One argv per prefix and form of each long flag: (field, tokens)."""
    cases = []
    for flag, field in flags.items():
        value = value_of(field)
        for end in range(3, len(flag) + 1):
            prefix = flag[:end]
            if flags.get(prefix, field) != field:
                continue  # another flag's whole name (--kv-cache-dtype of its -skip-layers)
            cases.append({"field": field, "tokens": [prefix] if value is None else [prefix, value]})
            if value is not None:
                cases.append({"field": field, "tokens": [f"{prefix}={value}"]})
    return cases


# SGLang's own parser, built as prepare_server_args builds it; a refusal is "error".
SGLANG_PARSE = textwrap.dedent("""
    import argparse, contextlib, io, json, sys
    from sglang.srt.server_args import ServerArgs
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    out = []
    for argv in json.loads(sys.stdin.read()):
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                ns = p.parse_args(argv)
        except SystemExit:
            out.append("error")
            continue
        scalar = (str, int, bool, type(None))
        out.append({k: v for k, v in vars(ns).items() if isinstance(v, scalar)})
    print(json.dumps(out))
""")


def _agree(
    cases: list[dict[str, Any]],
    argvs: list[list[str]],
    theirs: list[Any],
    ours: Callable[[list[str]], dict[str, Any]],
) -> None:
    """Where the engine refused an argv ("error"), cachemgr refuses it; where the engine read
    a value for the case's field, cachemgr reads the same; both kinds occur."""
    refused = 0
    for case, argv, real in zip(cases, argvs, theirs, strict=True):
        try:
            read = ours(argv)
        except ConfigError:
            assert real == "error", argv
            refused += 1
            continue
        assert real != "error", argv
        assert read[case["field"]] == real[case["field"]], argv
    assert 0 < refused < len(cases)


def _run(engine: ScriptRunner, script: str, argvs: list[list[str]]) -> list[Any]:
    """What the engine's parser, built by `script`, reads from each argv."""
    result: list[Any] = json.loads(engine.run(script, stdin=json.dumps(argvs)))
    return result


def _sglang_value(field: str) -> str | None:
    if field in SGLANG_BOOLS:
        return None
    if field == "dwdp_size":
        return "0"  # not the default, and no DWDP: 2 alone is refused (it must equal --tp-size)
    return _value(field, sglang_flags.CHOICES, sglang_flags.INTEGER)


@pytest.mark.sglang
def test_every_abbreviation_reads_as_sglangs_parser_reads_it(sglang_scripts: ScriptRunner) -> None:
    cases = _cases(sglang_args.FLAGS, _sglang_value)
    base = ["--model-path", "/m"]
    argvs = [[*base, *c["tokens"]] for c in cases]
    theirs = _run(sglang_scripts, SGLANG_PARSE, argvs)

    def ours(argv: list[str]) -> dict[str, Any]:
        return sglang_args.resolve_launch_args(["sglang", "serve", *argv]).model_dump()

    _agree(cases, argvs, theirs, ours)


VLLM_PARSE = textwrap.dedent("""
    import contextlib, io, json, sys
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser()
    make_arg_parser(parser.add_subparsers().add_parser("serve"))
    out = []
    for argv in json.loads(sys.stdin.read()):
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                a = vars(parser.parse_args(argv))
        except SystemExit:
            out.append("error")
            continue
        a["model"] = a.get("model_tag") or a.get("model")
        names = a.get("served_model_name")
        a["served_model_name"] = names[0] if names else None
        hf = a.get("hf_overrides")
        a["hf_overrides"] = json.dumps(hf, sort_keys=True, separators=(",", ":")) if hf else None
        a["kv_transfer_config"] = a["kv_transfer_config"] is not None
        a["kv_cache_dtype_skip_layers"] = sorted(set(a.get("kv_cache_dtype_skip_layers") or []))
        scalar = (str, int, bool, type(None))
        out.append({k: v for k, v in a.items() if isinstance(v, scalar) or k.endswith("_layers")})
    print(json.dumps(out))
""")


VLLM_BOOLS = {"trust_remote_code", "allow_deprecated_quantization"}


def _vllm_value(field: str) -> str | None:
    if field in VLLM_BOOLS:
        return None
    return _value(field, vllm_flags.CHOICES, vllm_flags.INTEGER)


def _vllm_short_cases() -> list[dict[str, Any]]:
    """vLLM's short flags: every prefix, the value attached (`-tp2`) and after `=`."""
    cases = []
    for short, long in vllm_flags.ALIASES.items():
        field = vllm_args.FLAGS.get(long)
        if field is None:
            continue  # -dp: not a setting cachemgr reads
        value = _vllm_value(field) or ""
        for end in range(2, len(short) + 1):
            cases.append({"field": field, "tokens": [short[:end], value]})
        cases += [{"field": field, "tokens": [short + value]}]
        cases += [{"field": field, "tokens": [f"{short}={value}"]}]
    return cases


@pytest.mark.vllm
def test_every_abbreviation_reads_as_vllms_parser_reads_it(vllm_scripts: ScriptRunner) -> None:
    record = vllm_args.VllmLaunchArgs.model_fields  # (the offloading flags only steer the tier)
    flags = {
        f: field for f, field in vllm_args.FLAGS.items() if field in record and field != "model"
    }
    cases = _cases(flags, _vllm_value) + _vllm_short_cases()
    # vLLM's own rewrite first: `_` is `-` in a flag's name (`--max_model_le`).
    cases += [
        {
            "field": c["field"],
            "tokens": ["--" + c["tokens"][0][2:].replace("-", "_"), *c["tokens"][1:]],
        }
        for c in _cases(flags, _vllm_value)
        if c["tokens"][0].startswith("--")
    ]
    base = ["serve", "/m"]
    argvs = [[*base, *c["tokens"]] for c in cases]
    theirs = _run(vllm_scripts, VLLM_PARSE, argvs)

    def ours(argv: list[str]) -> dict[str, Any]:
        read = vllm_args.resolve_vllm_args(["vllm", *argv]).model_dump()
        read["kv_transfer_config"] = read["kv_transfer_config"] is not None  # as VLLM_PARSE
        read["kv_cache_dtype_skip_layers"] = sorted(read["kv_cache_dtype_skip_layers"])
        return read

    _agree(cases, argvs, theirs, ours)


def test_the_issues_abbreviations_read_as_their_flags() -> None:
    sglang = sglang_args.resolve_launch_args(
        "sglang serve --model-path m --kv-cache-dtyp fp8_e4m3 --page-si 32"
    )
    assert (sglang.kv_cache_dtype, sglang.resolved_page_size) == ("fp8_e4m3", 32)
    # SGLang has one --kv-cache-dt… flag; vLLM has two, so there the prefix is ambiguous.
    assert sglang_args.resolve_launch_args("--model-path m --kv-cache-dt=fp8_e5m2").kv_cache_dtype
    vllm = vllm_args.resolve_vllm_args(["vllm", "serve", "m", "--max-model-le", "32k"])
    assert vllm.max_model_len == 32000
    with pytest.raises(ConfigError, match=r"ambiguous flag --kv-cache-dt: vLLM 0.34.0 could"):
        vllm_args.resolve_vllm_args(["vllm", "serve", "m", "--kv-cache-dt", "fp8"])


def test_a_launch_with_vllm_0_34_flags_reads_and_its_new_ambiguities_are_refused() -> None:
    # Flags vLLM 0.34.0 added, of each kind: refused as unknown while the table was 0.33.0's.
    new = ["--enable-extensible-kv-cache", "--max-num-inflight-kv-loads", "4"]
    argv = ["vllm", "serve", "m", *new, "--no-shuffle-safetensors-files", "--kv-cache-dtype", "fp8"]
    vllm = vllm_args.resolve_vllm_args(argv)
    assert (vllm.model, vllm.kv_cache_dtype) == ("m", "fp8")
    # 0.33.0 read --enable-ex as --enable-expert-parallel; 0.34.0 refuses it: so does cachemgr.
    with pytest.raises(ConfigError, match=r"ambiguous flag --enable-ex: vLLM 0.34.0 could"):
        vllm_args.resolve_vllm_args(["vllm", "serve", "m", "--enable-ex"])


@pytest.mark.parametrize(
    ("token", "read"),
    [
        ("--page-size", ("--page-size", None)),  # exact
        ("--page-s=4", ("--page-size", "4")),  # a prefix up to its `=`
        ("--model", ("--model", None)),  # exact wins over --model-path
        ("-1", None),  # a negative number is a value
        ("-", None),
        ("plain", None),
        ("-x y", None),  # a space: a value
    ],
)
def test_argparse_rules(token: str, read: tuple[str, str | None] | None) -> None:
    option = read_option(token, sglang_flags.OPTIONS, "SGLang")
    assert (option and (option.name, option.explicit)) == read


def test_a_short_flag_takes_an_attached_value() -> None:
    option = read_option("-qawq", vllm_flags.OPTIONS, "vLLM")
    assert option is not None and (option.name, option.explicit) == ("-q", "awq")


@pytest.mark.parametrize(
    ("command", "message"),
    [
        ("--model-path m --totally-bogus 3", "unknown flag --totally-bogus: SGLang 0.5.23"),
        ("--model-path m --cuda-graph-max-bs 1", "ambiguous flag --cuda-graph-max-bs: SGLang"),
        ("--model-path m --enable-hi", "could read it as --enable-hicache, --enable-hier"),
        ("--model-path m --conf x.yaml", "uses --config"),
    ],
)
def test_sglang_refusals_name_the_flag(command: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        sglang_args.resolve_launch_args(command)


def test_model_type_is_taken_out_as_sglang_serve_does() -> None:
    args = sglang_args.resolve_launch_args("sglang serve --model-type llm --model-path m")
    assert args.model_path == "m"


@pytest.mark.vllm
def test_abbreviated_config_keys_read_as_vllms_parser_reads_them(
    tmp_path: Path, vllm_scripts: ScriptRunner
) -> None:
    # vLLM splices a --config file's keys in as `--key value`, before argparse reads them.
    unique, ambiguous = tmp_path / "unique.yaml", tmp_path / "ambiguous.yaml"
    unique.write_text("max_model_le: 16k\nblock_si: 32\n")
    ambiguous.write_text("kv_cache_dtyp: fp8\n")
    argvs = [["serve", "/m", "--config", str(p)] for p in (unique, ambiguous)]
    theirs = _run(vllm_scripts, VLLM_PARSE, argvs)
    ours = vllm_args.resolve_vllm_args(["vllm", *argvs[0]])
    assert (ours.max_model_len, ours.block_size) == (16000, 32)
    assert (theirs[0]["max_model_len"], theirs[0]["block_size"]) == (16000, 32)
    assert theirs[1] == "error"
    with pytest.raises(ConfigError, match="ambiguous flag --kv-cache-dtyp"):
        vllm_args.resolve_vllm_args(["vllm", *argvs[1]])
