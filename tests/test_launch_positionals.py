"""Positional words in a launch read as the engines' parsers read them.

SGLang 0.5.23's `sglang serve <model> …` takes the model as its first word (cli/serve.py
`_normalize_positional_model_path`); any other word is refused by SGLang's parse_args, and by
vLLM's after `vllm serve`'s one positional. A launch the engine refuses must not get a
namespace: cachemgr refuses it too, naming the word."""

from __future__ import annotations

from typing import Any

import pytest

from cachemgr.errors import ConfigError
from cachemgr.sglang import args as sglang_args
from cachemgr.vllm import args as vllm_args
from tests.conftest import ScriptRunner
from tests.test_launch_abbrev import SGLANG_PARSE, VLLM_PARSE, _run


def test_sglang_serve_takes_the_model_as_its_first_word() -> None:
    args = sglang_args.resolve_launch_args(
        "sglang serve /models/m --kv-cache-dtyp fp8_e4m3 --page-si 32"
    )
    assert (args.model_path, args.kv_cache_dtype, args.page_size) == ("/models/m", "fp8_e4m3", 32)
    # `--model-type` comes out first, so the model may follow it.
    typed = sglang_args.resolve_launch_args("sglang serve --model-type llm /models/m")
    assert typed.model_path == "/models/m"


SGLANG_STRAYS = [
    ["--model-path", "m", "--port", "30000", "stray"],
    ["--model-path", "m", "--trust-remote-code", "yes"],
    ["--model-path", "m", "--kv-cache-dtype", "fp8_e4m3", "--", "--kv-cache-dtype", "bf16"],
    ["--model-path", "m", "--kv-cache-dtype", "fp8_e4m3", "fp8_e5m2"],
]


@pytest.mark.parametrize("argv", SGLANG_STRAYS)
def test_a_word_sglang_refuses_is_refused(argv: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"unrecognized argument .*: SGLang 0.5.23 refuses"):
        sglang_args.resolve_launch_args(["python", "-m", "sglang.launch_server", *argv])


@pytest.mark.sglang
def test_sglangs_own_parser_refuses_the_same_words(sglang_scripts: ScriptRunner) -> None:
    theirs = _run(sglang_scripts, SGLANG_PARSE, SGLANG_STRAYS)
    assert theirs == ["error"] * len(SGLANG_STRAYS)


VLLM_STRAYS = [
    ["serve", "m", "stray"],
    ["serve", "m", "--model", "n"],
    ["serve", "m", "--", "--kv-cache-dtype", "fp8"],
]


@pytest.mark.parametrize("argv", VLLM_STRAYS)
def test_a_word_vllm_refuses_is_refused(argv: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"unrecognized argument .*: vLLM 0.34.0 refuses"):
        vllm_args.resolve_vllm_args(["vllm", *argv])


@pytest.mark.vllm
def test_vllms_own_parser_refuses_the_same_words(vllm_scripts: ScriptRunner) -> None:
    kept: list[list[str]] = [["serve", "--dtype", "half", "m"], ["serve", "--", "m"]]
    theirs: list[Any] = _run(vllm_scripts, VLLM_PARSE, VLLM_STRAYS + kept)
    assert theirs[: len(VLLM_STRAYS)] == ["error"] * len(VLLM_STRAYS)
    for argv, real in zip(kept, theirs[len(VLLM_STRAYS) :], strict=True):
        assert real != "error" and real["model"] == "m"
        assert vllm_args.resolve_vllm_args(["vllm", *argv]).model == "m"


@pytest.mark.parametrize(
    "command",
    [
        # `--model` and `--kv-cache-dtype fp8_e4m3` are SGLang flags too: read as SGLang's,
        # this vLLM launch got an SGLang namespace, exit 0
        ["nice", "-n", "5", "vllm", "serve", "--model", "/m", "--kv-cache-dtype", "fp8_e4m3"],
        ["nohup", "python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"],
        ["bash", "-c", "vllm serve /m --kv-cache-dtype fp8", "--model", "/m"],
    ],
)
def test_a_vllm_launch_behind_a_wrapper_is_not_read_as_sglangs(command: list[str]) -> None:
    assert not vllm_args.is_vllm_launch(command)
    with pytest.raises(ConfigError, match="runs vLLM behind"):
        sglang_args.resolve_launch_args(command)
