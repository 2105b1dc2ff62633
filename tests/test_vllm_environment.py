"""The VLLM_* environment variables that change what an offloaded block's bytes mean
(VLLM_MLA_DISABLE, VLLM_SSM_CONV_STATE_LAYOUT, VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT, and those
that pick the attention backend) are in a vLLM launch's identity, read as vLLM 0.34.0's
envs.py reads them; a value its start would end in is refused before anything is purged."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from cachemgr.errors import ConfigError
from cachemgr.vllm.args import resolve_vllm_args
from tests.conftest import ScriptRunner
from tests.nsfixtures import one_line_error
from tests.test_identity import make_model
from tests.vllm_launch import launch, vinit, vinit_json

NAMES = (
    "VLLM_MLA_DISABLE",
    "VLLM_BATCH_INVARIANT",
    "VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT",
    "VLLM_ROCM_USE_AITER",
    "VLLM_ROCM_USE_AITER_MHA",
    "VLLM_ROCM_USE_AITER_MLA",
    "VLLM_SSM_CONV_STATE_LAYOUT",
    "VLLM_FP8_MOE_REQUANT",
    "VLLM_FP8_MOE_REQUANT_ACT",
    "VLLM_ROCM_MUSE_MOE_ONLINE_QUANT",
)
VALUES = ["0", "1", "2", " 1 ", "-1", "", "true", "True", "FALSE", "yes", "SD", "DS", "ds"]
VALUES += ["none", "mxfp4", "MXFP4", "a8w4", "a4w4", "A16W4"]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return make_model(tmp_path / "model")


def test_a_variable_that_changes_the_blocks_gets_its_own_namespace(root: Path, model: Path) -> None:
    """VLLM_MLA_DISABLE=1 makes an MLA model cache full K/V heads under the layer names and
    folder digest of its latent cache: the server with it must not read the other's blocks.
    Set to vLLM's default, or unset, it is the namespace launches had before."""
    for name, value in (("VLLM_MLA_DISABLE", "1"), ("VLLM_SSM_CONV_STATE_LAYOUT", "DS")):
        plain = vinit_json(root, launch(model))["ns_id"]
        other = vinit_json(root, ["env", f"{name}={value}", *launch(model)])
        assert other["outcome"] == "changed" and other["ns_id"] != plain, name
        assert other["changes"] == [f"environment.{name}: none → {value}"]
        # inherited from the environment init runs in, it is the same identity
        assert vinit_json(root, launch(model), env={name: value})["ns_id"] == other["ns_id"]
    for name, value in (
        ("VLLM_MLA_DISABLE", "0"),
        ("VLLM_SSM_CONV_STATE_LAYOUT", "SD"),
        ("VLLM_ROCM_USE_AITER_MHA", "true"),
    ):
        assert vinit_json(root, ["env", f"{name}={value}", *launch(model)])["ns_id"] == plain


@pytest.mark.parametrize(
    ("name", "value"),
    [("VLLM_MLA_DISABLE", "yes"), ("VLLM_MLA_DISABLE", ""), ("VLLM_SSM_CONV_STATE_LAYOUT", "ds")],
)
def test_a_value_vllm_refuses_is_one_line_exit_2_and_the_cache_is_kept(
    root: Path, model: Path, name: str, value: str
) -> None:
    good = vinit_json(root, launch(model))
    block = root / "ns" / good["ns_id"] / "block.bin"
    block.write_bytes(b"x")
    before = sorted(p.name for p in (root / "ns").iterdir())
    out = vinit(root, ["env", f"{name}={value}", *launch(model)])
    assert out.returncode == 2 and f"invalid {name}={value!r}" in one_line_error(out)
    assert block.exists() and sorted(p.name for p in (root / "ns").iterdir()) == before


# What vLLM runs with: envs.py's value as its reader takes it (the conv state layout as
# mamba_utils resolves it, the requantization as fp8.py and fp8_requant.py compare it).
ENV_READS = textwrap.dedent("""
    import json, os, sys
    import vllm.envs
    from vllm.model_executor.layers.mamba import mamba_utils

    def read(name):
        value = vllm.envs.environment_variables[name]()
        if name == "VLLM_SSM_CONV_STATE_LAYOUT":
            mamba_utils.get_conv_state_layout.cache_clear()
            return mamba_utils.get_conv_state_layout()
        if name == "VLLM_FP8_MOE_REQUANT":
            return value == "mxfp4"
        if name == "VLLM_FP8_MOE_REQUANT_ACT":
            return value.lower()
        return value

    asked = json.loads(sys.stdin.read())
    reads = {}
    for name in asked["names"]:
        os.environ.pop(name, None)
        reads[name] = {"unset": read(name)}
        for value in asked["values"]:
            os.environ[name] = value
            try:
                reads[name][value] = read(name)
            except ValueError:
                reads[name][value] = "refused"
        os.environ.pop(name)
    print(json.dumps(reads))
""")


@pytest.mark.vllm
def test_read_as_vllms_own_envs_reads_them(vllm_scripts: ScriptRunner, model: Path) -> None:
    """Against vLLM 0.34.0's envs.py: a value it refuses cachemgr refuses; two values it reads
    alike are one identity, two it reads apart two; its default is the launch without it."""
    asked = {"names": list(NAMES), "values": VALUES}
    theirs = json.loads(vllm_scripts.run(ENV_READS, stdin=json.dumps(asked)))
    for name in NAMES:
        ids: dict[str, set[str]] = {}
        for value in ["unset", *VALUES]:
            env = {} if value == "unset" else {name: value}
            try:
                args = resolve_vllm_args(launch(model), env)
            except ConfigError:
                assert theirs[name][value] == "refused", (name, value)
                continue
            assert theirs[name][value] != "refused", (name, value)
            kept = (args.kv_environment or {}).get(name)
            ids.setdefault(json.dumps(theirs[name][value]), set()).add(str(kept))
        assert all(len(kept) == 1 for kept in ids.values()), (name, ids)
        assert len({k for s in ids.values() for k in s}) == len(ids), (name, ids)
        assert ids[json.dumps(theirs[name]["unset"])] == {"None"}, name


def test_a_humming_config_counts_by_its_content(root: Path, model: Path, tmp_path: Path) -> None:
    """VLLM_HUMMING_ONLINE_QUANT_CONFIG (and _INPUT_) set how the humming kernels quantize the
    weights: JSON, or the path of a JSON file, whose content is what counts."""
    name = "VLLM_HUMMING_ONLINE_QUANT_CONFIG"
    plain = vinit_json(root, launch(model))["ns_id"]
    given = vinit_json(root, ["env", f'{name}={{"bits": 4, "group": 128}}', *launch(model)])
    assert given["ns_id"] != plain
    file = tmp_path / "humming.json"
    file.write_text('{"group": 128,\n "bits": 4}\n')
    from_file = vinit_json(root, ["env", f"{name}={file}", *launch(model)])
    assert from_file["ns_id"] == given["ns_id"]
    file.write_text('{"bits": 8, "group": 128}')
    assert vinit_json(root, ["env", f"{name}={file}", *launch(model)])["ns_id"] != given["ns_id"]
    for bad in ("{bits: 4}", str(tmp_path / "absent.json")):
        out = vinit(root, ["env", f"{name}={bad}", *launch(model)])
        assert out.returncode == 2 and f"invalid {name}=" in one_line_error(out)


@pytest.mark.vllm
def test_a_humming_config_is_read_as_vllm_reads_it(
    vllm_scripts: ScriptRunner, model: Path, tmp_path: Path
) -> None:
    file = tmp_path / "input.json"
    file.write_text('{"dtype": "fp8"}')
    values = ['{"dtype": "int8"}', str(file), "", "{dtype}", "[1, 2]", "null"]
    name = "VLLM_HUMMING_INPUT_QUANT_CONFIG"
    asked = json.dumps({"names": [name], "values": values})
    theirs = json.loads(vllm_scripts.run(ENV_READS, stdin=asked))[name]
    for value in values:
        try:
            args = resolve_vllm_args(launch(model), {name: value})
        except ConfigError:
            assert theirs[value] == "refused", value
            continue
        kept = (args.kv_environment or {})[name]
        assert json.loads(kept) == theirs[value], value
