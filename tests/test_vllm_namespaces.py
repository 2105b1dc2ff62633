"""vLLM 0.34.0's own fs tier under `cachemgr init`: the root_dir init hands the server is
where vLLM's FileSystemTierManager stores and finds its blocks. After a KV dtype, revision or
weights change the server is pointed at a new namespace and finds none of the old blocks;
the same launch again finds all of them. And the argv pre-pass reads what vLLM's own
FlexibleArgumentParser reads."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from safetensors.numpy import save_file

from cachemgr.errors import ConfigError
from cachemgr.vllm.args import resolve_vllm_args
from tests.conftest import VLLM_ENV, ScriptRunner, VllmDriver
from tests.test_identity import make_model
from tests.vllm_launch import launch, root_dir_of, tier_config, vinit_json

pytestmark = pytest.mark.vllm

PROMPT = [[7, 64]]  # 4 blocks of 16 tokens
_requests = itertools.count()


def serve(vllm: VllmDriver, result: dict[str, Any], model: str, kv_dtype: str) -> int:
    """vLLM's tier as the server started with init's command would build it."""
    root_dir = root_dir_of(result["command"])
    assert root_dir == str(Path(result["storage_dir"]))
    return int(vllm.open(Path(root_dir), model=model, dtype=kv_dtype, block_tokens=16)["handle"])


def hits(vllm: VllmDriver, handle: int) -> int:
    """Blocks of PROMPT vLLM's lookup finds (a fresh request: no cached verdicts)."""
    return int(vllm.call("lookup", handle=handle, tokens=PROMPT, req=f"q{next(_requests)}")["hit"])


def store(vllm: VllmDriver, result: dict[str, Any], model: str, kv_dtype: str) -> None:
    handle = serve(vllm, result, model, kv_dtype)
    assert vllm.call("store", handle=handle, tokens=PROMPT, tag="old")["stored"] == 4
    vllm.call("close", handle=handle)


def old_blocks_found(vllm: VllmDriver, result: dict[str, Any], model: str, kv_dtype: str) -> int:
    """Blocks the new server finds (lookup) or loads when it asks exactly as the old one
    stored them."""
    handle = serve(vllm, result, model, kv_dtype)
    try:
        found = hits(vllm, handle)
        req = f"l{next(_requests)}"
        loaded = vllm.call("load", handle=handle, tokens=PROMPT, tag="old", req=req)
        return found + int(loaded["loaded"])
    finally:
        vllm.call("close", handle=handle)


def test_a_kv_dtype_change_loads_no_old_block(vllm: VllmDriver, root: Path, tmp_path: Path) -> None:
    model = make_model(tmp_path / "model")
    first = vinit_json(root, launch(model, "--kv-cache-dtype", "fp8_e4m3"))
    store(vllm, first, str(model), "fp8_e4m3")
    second = vinit_json(root, launch(model, "--kv-cache-dtype", "fp8_e5m2"))
    assert second["changes"] == ["kv_cache_dtype: fp8_e4m3 → fp8_e5m2"]
    assert old_blocks_found(vllm, second, str(model), "fp8_e5m2") == 0
    assert old_blocks_found(vllm, second, str(model), "fp8_e4m3") == 0
    assert not Path(first["storage_dir"]).exists()
    assert (second["old_action"], second["old_pages"]) == ("purged", 4)  # counted as vLLM's
    # GC drains the purged namespace: its blocks, hashed dirs and identity files all go.
    gc = subprocess.run(
        [sys.executable, "-m", "cachemgr", "--root", str(root), "gc", "--yes"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert gc.returncode == 0, gc.stderr
    assert list((root / ".trash").iterdir()) == []


def test_a_revision_change_loads_no_old_block(vllm: VllmDriver, root: Path, tmp_path: Path) -> None:
    """Two revisions with the same files: vLLM's own folder digest is the same for both,
    so without cachemgr the second server would load the first one's blocks."""
    hub = tmp_path / "hub"
    repo = hub / "models--acme--tiny"
    commits = ["1" * 40, "2" * 40]
    for commit in commits:
        make_model(repo / "snapshots" / commit)
    env = {"HF_HUB_CACHE": str(hub)}
    first = vinit_json(root, launch("acme/tiny", "--revision", commits[0]), env=env)
    store(vllm, first, "acme/tiny", "bfloat16")
    second = vinit_json(root, launch("acme/tiny", "--revision", commits[1]), env=env)
    assert second["changes"] == [f"revision: {commits[0]} → {commits[1]}"]
    assert old_blocks_found(vllm, second, "acme/tiny", "bfloat16") == 0


def test_a_weights_change_loads_no_old_block(vllm: VllmDriver, root: Path, tmp_path: Path) -> None:
    model = make_model(tmp_path / "model")
    first = vinit_json(root, launch(model))
    store(vllm, first, str(model), "bfloat16")
    shard = model / "model-00002-of-00003.safetensors"  # fine-tuned in place, same name
    save_file({"layers.1.weight": make_tensor()}, str(shard))
    second = vinit_json(root, launch(model))
    assert second["changes"] == ["weights: model-00002-of-00003.safetensors changed"]
    assert old_blocks_found(vllm, second, str(model), "bfloat16") == 0


def make_tensor() -> Any:
    import numpy as np

    return np.ones((32, 16), dtype=np.float32)


def test_the_same_launch_again_loads_every_block(
    vllm: VllmDriver, root: Path, tmp_path: Path
) -> None:
    model = make_model(tmp_path / "model")
    first = vinit_json(root, launch(model, "--block-size", "16"))
    store(vllm, first, str(model), "bfloat16")
    again = vinit_json(root, launch(model, "--block-size", "16"))
    assert (again["outcome"], again["ns_id"]) == ("unchanged", first["ns_id"])
    handle = serve(vllm, again, str(model), "bfloat16")
    loaded = vllm.call("load", handle=handle, tokens=PROMPT, tag="old", req="restart")
    vllm.call("close", handle=handle)
    assert (loaded["loaded"], loaded["correct"], loaded["wrong"]) == (4, 4, 0)


# `vllm`'s own parser on the same argv, built as its CLI builds it (entrypoints/cli/main.py:
# a FlexibleArgumentParser whose `serve` subparser is make_arg_parser's, cli/serve.py
# subparser_init; serve.py itself imports uvicorn, which the test env lacks), and the
# values cachemgr reads.
PARSE = textwrap.dedent("""
    import json, sys
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    out = []
    for argv in json.loads(sys.stdin.read()):
        parser = FlexibleArgumentParser()
        make_arg_parser(parser.add_subparsers().add_parser("serve"))
        a = parser.parse_args(argv)
        kv = a.kv_transfer_config
        out.append({
            "model": getattr(a, "model_tag", None) or a.model,
            "kv_cache_dtype": a.kv_cache_dtype, "max_model_len": a.max_model_len,
            "tp": a.tensor_parallel_size, "block_size": a.block_size,
            "hf_overrides": a.hf_overrides or None,
            "tiers": kv.kv_connector_extra_config.get("secondary_tiers") if kv else None,
            "connector": kv.kv_connector if kv else None,
        })
    print(json.dumps(out))
""")


def test_the_prepass_reads_what_vllms_parser_reads(
    tmp_path: Path, vllm_scripts: ScriptRunner
) -> None:
    yaml_file = tmp_path / "serve.yaml"
    yaml_file.write_text(
        "kv_cache_dtype: fp8\nmax-model-len: 16k\nblock_size: 32\n"
        f"kv-transfer-config: {json.dumps(tier_config('/from/yaml'))}\n"
    )
    tiers = json.dumps([{"type": "fs", "root_dir": "/dotted"}])
    argvs = [
        [
            "serve",
            "/m",
            "--max_model_len=32K",
            "-tp",
            "2",
            "--kv-cache-dtype",
            "fp8_e5m2",
            "--kv_transfer_config",
            json.dumps(tier_config("/plain")),
        ],
        [
            "serve",
            "-tp",
            "2",
            "--model",
            "/m",
            "--hf-overrides.rope_scaling.factor",
            "4",
            "--hf-overrides.rope_scaling.rope_type=yarn",
            "--max-model-len",
            "auto",
            "--kv-transfer-config.kv_connector",
            "OffloadingConnector",
            "--kv-transfer-config.kv_role",
            "kv_both",
            "--kv-transfer-config.kv_connector_extra_config.spec_name",
            "TieringOffloadingSpec",
            "--kv-transfer-config.kv_connector_extra_config.secondary_tiers",
            tiers,
        ],
        ["serve", "/m", "--config", str(yaml_file), "--max-model-len", "8k"],
        [
            "serve",
            "/m",
            "--kv-transfer-config",
            json.dumps(tier_config("/first")),
            "--kv-transfer-config.kv_connector_extra_config.secondary_tiers",
            tiers,
        ],
    ]
    real = vllm_scripts.run(PARSE, stdin=json.dumps(argvs))
    *read, dotted_over_plain = json.loads(real)
    # vLLM builds the flag anew from a dotted key after a whole value: no connector, so its tier
    # would not run. cachemgr says so rather than manage a dir nothing writes to.
    assert dotted_over_plain["connector"] is None and dotted_over_plain["tiers"]
    with pytest.raises(ConfigError, match="vLLM would not run its fs tier: no kv_connector"):
        resolve_vllm_args(["vllm", *argvs[-1]])
    for argv, theirs in zip(argvs[:-1], read, strict=True):
        ours = resolve_vllm_args(["vllm", *argv])
        assert ours.model == theirs["model"]
        assert ours.kv_cache_dtype == theirs["kv_cache_dtype"]
        assert (ours.max_model_len or -1) == (theirs["max_model_len"] or -1)
        assert ours.tensor_parallel_size == theirs["tp"]
        assert ours.block_size == theirs["block_size"]
        overrides = theirs["hf_overrides"]
        assert ours.hf_overrides == (
            json.dumps(overrides, sort_keys=True, separators=(",", ":")) if overrides else None
        )
        (fs,) = [t for t in theirs["tiers"] if t["type"] == "fs"]
        assert ours.tier is not None and ours.tier.root_dir == fs["root_dir"], argv


def exec_vllm(root: Path, command: list[str], op: str, tmp_path: Path) -> dict[str, Any]:
    """`cachemgr exec -- COMMAND` where `vllm` is tests/vllm_serve_stub.py: vLLM's own parser
    and fs tier, storing or loading one prompt's blocks (op)."""
    bindir = tmp_path / "bin"
    if not bindir.exists():
        bindir.mkdir()
        stub = bindir / "vllm"
        script = Path(__file__).with_name("vllm_serve_stub.py")
        stub.write_text(f'#!/bin/sh\nexec "{VLLM_ENV}/bin/python" "{script}" "$@"\n')
        stub.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "CACHEMGR_"))}
    env = {**clean, "PATH": f"{bindir}:{os.environ['PATH']}", "STUB_OP": op}
    out = subprocess.run(
        [sys.executable, "-m", "cachemgr", "--root", str(root), "exec", "--", *command],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    result["said"] = out.stderr
    return result


# Three vLLM starts (~10 s of imports each on a quiet box) took past the suite's 300 s beside
# a loaded parallel pass.
@pytest.mark.timeout(900)
def test_exec_runs_vllm_on_its_namespace_and_a_restart_loads_its_blocks(
    root: Path, tmp_path: Path
) -> None:
    """The whole path: exec rewrites the dotted tier, vLLM's parser reads it, vLLM's tier
    writes below the namespace; the same launch loads every block, a weights change none."""
    model = make_model(tmp_path / "model")
    tiers = json.dumps([{"type": "fs", "root_dir": "/srv/kv"}])
    command = [
        "vllm",
        "serve",
        str(model),
        "--kv_cache_dtype",
        "fp8_e4m3",
        "--kv-transfer-config.kv_connector",
        "OffloadingConnector",
        "--kv-transfer-config.kv_role",
        "kv_both",
        "--kv-transfer-config.kv_connector_extra_config.spec_name",
        "TieringOffloadingSpec",
        "--kv-transfer-config.kv_connector_extra_config.secondary_tiers",
        tiers,
    ]
    stored = exec_vllm(root, command, "store", tmp_path)
    (ns,) = [p for p in (root / "ns").iterdir() if p.is_dir()]
    assert stored["root_dir"] == str(ns) and stored["stored"] == 4
    assert Path(stored["base_path"]).parent == ns  # vLLM's folder inside the namespace
    again = exec_vllm(root, command, "load", tmp_path)
    assert "identity unchanged" in again["said"]
    assert (again["loaded"], again["correct"]) == (4, 4)
    save_file({"layers.0.weight": make_tensor()}, str(model / "model-00001-of-00003.safetensors"))
    changed = exec_vllm(root, command, "load", tmp_path)
    assert "weights: model-00001-of-00003.safetensors changed" in changed["said"]
    assert changed["root_dir"] != str(ns) and changed["loaded"] == 0
    assert not ns.exists()
