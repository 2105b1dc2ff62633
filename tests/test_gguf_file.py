"""A model path that is one GGUF file: SGLang serves it (GGUFModelLoader, its config from a
config.json beside it or from the file), so cachemgr fingerprints that file's content; vLLM
has no GGUF loader, and the refusal says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachemgr.errors import IdentityError
from cachemgr.identity.hashing import ALGO_FULL, hash_file
from cachemgr.sglang.record import Identity
from cachemgr.vllm.args import resolve_vllm_args
from cachemgr.vllm.identity import compute_vllm_identity
from tests.nsfixtures import cli, one_line_error
from tests.test_identity import age, ident
from tests.test_init import CMD, NO_STORAGE_ENV
from tests.vllm_launch import launch as vllm_launch


def gguf(path: Path, body: bytes) -> Path:
    path.write_bytes(b"GGUF" + body)
    return path


@pytest.fixture
def quants(tmp_path: Path) -> Path:
    """A dir of GGUF quantizations of one model, with its config.json, as Hub repos have."""
    repo = tmp_path / "repo"
    repo.mkdir()
    gguf(repo / "m-Q4_K_M.gguf", b"q4" * 100)
    gguf(repo / "m-Q8_0.gguf", b"q8" * 100)
    (repo / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    age(repo)
    return repo


def served(path: Path, *flags: str) -> Identity:
    return ident(" ".join(["--model-path", str(path), *flags]))


def test_sglang_fingerprints_the_file_and_the_config_beside_it(
    quants: Path, tmp_path: Path
) -> None:
    q4 = served(quants / "m-Q4_K_M.gguf")
    assert [f.name for f in q4.weights.files] == ["config.json", "m-Q4_K_M.gguf"]
    digest = hash_file(quants / "m-Q4_K_M.gguf").digest
    assert (q4.weights.algo, q4.weights.files[1].digest) == (ALGO_FULL, digest)
    assert (q4.dtype, q4.source.model_dir) == ("bfloat16", str(quants / "m-Q4_K_M.gguf"))
    # the same digest as a model dir holding just that file and config.json
    alone = tmp_path / "alone"
    alone.mkdir()
    for name in ("m-Q4_K_M.gguf", "config.json"):
        (alone / name).write_bytes((quants / name).read_bytes())
    assert served(alone).weights == q4.weights
    # another quantization is another namespace; editing it does not touch this one
    assert served(quants / "m-Q8_0.gguf").ns_id != q4.ns_id
    gguf(quants / "m-Q8_0.gguf", b"other")
    assert served(quants / "m-Q4_K_M.gguf").ns_id == q4.ns_id
    gguf(quants / "m-Q4_K_M.gguf", b"edited")
    assert served(quants / "m-Q4_K_M.gguf").ns_id != q4.ns_id


def test_a_gguf_file_without_a_config_keeps_auto_dtype_unresolved(tmp_path: Path) -> None:
    """Its config is in the file's metadata (dtype, model_type: gemma runs in bf16), which
    cachemgr does not read: `auto` must not be taken for float16 and share its namespace."""
    file = gguf(tmp_path / "model.gguf", b"x" * 64)
    auto = served(file)
    assert (auto.dtype, auto.kv_cache_dtype) == ("auto", "auto")
    assert served(file, "--dtype float16").ns_id != auto.ns_id
    assert served(file, "--load-format gguf").ns_id == auto.ns_id


def test_only_what_sglang_reads_as_gguf_is_a_model_file(tmp_path: Path) -> None:
    """check_gguf_file: named *.gguf, or starting with the magic; another load format
    loads no file."""
    magic = gguf(tmp_path / "model.bin", b"x" * 64)
    assert [f.name for f in served(magic).weights.files] == ["model.bin"]
    other = tmp_path / "weights.safetensors"
    other.write_bytes(b"not gguf")
    for path, flags in ((other, ""), (magic, "--load-format safetensors")):
        with pytest.raises(IdentityError, match="is not a directory"):
            served(path, flags)


def test_init_makes_a_namespace_for_a_gguf_file(quants: Path, tmp_path: Path) -> None:
    launch = [*CMD.split(), "--model-path", str(quants / "m-Q4_K_M.gguf")]
    out = cli("--root", str(tmp_path / "root"), "init", "--json", "--", *launch, env=NO_STORAGE_ENV)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["outcome"] == "created"


def test_vllm_refuses_a_gguf_file_saying_why(quants: Path, tmp_path: Path) -> None:
    file = str(quants / "m-Q4_K_M.gguf")
    with pytest.raises(IdentityError, match=r"single GGUF file: vLLM .* has no GGUF loader"):
        compute_vllm_identity(resolve_vllm_args(vllm_launch(file), {}), env={})
    out = cli("--root", str(tmp_path / "root"), "init", "--", *vllm_launch(file))
    assert out.returncode == 2 and "single GGUF file" in one_line_error(out)
