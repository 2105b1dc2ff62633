"""--quantization-param-path: SGLang stores FP8 KV divided by the file's scales, so the
file's content (not its path) is part of the identity whenever SGLang would load it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cachemgr.identity.record import diff_identities
from cachemgr.sglang.record import Identity
from tests.nsfixtures import cli, cli_process
from tests.test_identity import ident, make_model
from tests.test_init import CMD, NO_STORAGE_ENV


def scales_file(path: Path, scale: float) -> Path:
    data = {
        "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": scale, "1": scale}}}
    }
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return make_model(tmp_path / "model")


def fp8(model: Path, *flags: str) -> Identity:
    return ident(" ".join(["--model-path", str(model), "--kv-cache-dtype fp8_e4m3", *flags]))


def test_the_scales_file_changes_an_fp8_identity(model: Path, tmp_path: Path) -> None:
    half = scales_file(tmp_path / "half.json", 0.5)
    without = fp8(model)
    with_half = fp8(model, "--quantization-param-path", str(half))
    assert with_half.ns_id != without.ns_id
    assert with_half.source.kv_cache_scales_path == str(half)
    [line] = diff_identities(without, with_half)
    assert line.startswith("kv_cache_scales: none → xxh3-128:")
    quarter = scales_file(tmp_path / "quarter.json", 0.25)
    assert fp8(model, "--quantization-param-path", str(quarter)).ns_id != with_half.ns_id


def test_a_moved_copy_keeps_the_namespace_an_edit_does_not(model: Path, tmp_path: Path) -> None:
    path = scales_file(tmp_path / "scales.json", 0.5)
    before = fp8(model, "--quantization-param-path", str(path))
    moved = tmp_path / "elsewhere" / "renamed.json"
    moved.parent.mkdir()
    shutil.move(path, moved)
    assert fp8(model, f"--quantization-param-path={moved}").ns_id == before.ns_id
    scales_file(moved, 0.75)
    assert fp8(model, "--quantization-param-path", str(moved)).ns_id != before.ns_id


def test_scales_count_only_where_sglang_loads_them(model: Path, tmp_path: Path) -> None:
    """load_kv_cache_scales reads the file for fp8_e4m3 only; `auto` becomes it for a few
    models only (arg_groups/overrides.py), so for any other model a launch with the flag
    keeps the namespace it had before the scales were read."""
    path = scales_file(tmp_path / "scales.json", 0.5)
    flag = f"--quantization-param-path {path}"
    for kv in ("bfloat16", "fp8_e5m2"):
        base = ident(f"--model-path {model} --kv-cache-dtype {kv}")
        assert ident(f"--model-path {model} --kv-cache-dtype {kv} {flag}").ns_id == base.ns_id
    auto = ident(f"--model-path {model}")
    assert ident(f"--model-path {model} {flag}").ns_id == auto.ns_id
    for arch, extra in (
        ("MuseSparkForConditionalGeneration", {}),
        ("DeepseekV32ForCausalLM", {"index_topk": 2048}),  # DSA: fp8 on SM100
    ):
        over = make_model(tmp_path / arch, extra_config={"architectures": [arch], **extra})
        auto = ident(f"--model-path {over}")
        assert ident(f"--model-path {over} {flag}").ns_id != auto.ns_id
    # nullable_str: an empty path or None is no file
    assert fp8(model, "--quantization-param-path None").ns_id == fp8(model).ns_id


def test_without_the_flag_the_record_digest_is_as_before(model: Path) -> None:
    """The namespace id of every launch without the flag is what it was before the field
    existed: an unset kv_cache_scales is not in the digested bytes."""
    plain = fp8(model)
    assert plain.kv_cache_scales is None
    assert b"kv_cache_scales" not in plain.canonical()
    # and a record read back from a manifest written before the field keeps its digest
    data = plain.model_dump(mode="json")
    del data["kv_cache_scales"]
    assert Identity.model_validate(data).digest == plain.digest


def test_an_unreadable_file_is_warned_about_not_shared(model: Path, tmp_path: Path) -> None:
    """SGLang only logs an error for a file it cannot read and runs with scales of 1.0: a
    warning, not a refusal; the value still keeps the launch out of the flagless namespace
    (the server may see a file cachemgr does not)."""
    missing = tmp_path / "nope.json"
    unread = fp8(model, "--quantization-param-path", str(missing))
    assert unread.kv_cache_scales == f"unread:{missing}"
    assert unread.ns_id != fp8(model).ns_id


def test_an_unreadable_file_is_said_where_the_other_warnings_are(
    model: Path, tmp_path: Path
) -> None:
    """The warning was only a log line: `init`, `exec` and `fingerprint` say it on stderr as
    `cachemgr: warning:` and `init --json` in its warnings, as every launch warning."""
    missing = tmp_path / "nope.json"
    flags = [*CMD.split()[2:], "--model-path", str(model), "--kv-cache-dtype", "fp8_e4m3"]
    flags += ["--quantization-param-path", str(missing)]
    said = f"--quantization-param-path {missing} is not readable here"
    root = str(tmp_path / "root")
    out = cli("--root", root, "init", "--json", "--", "sglang", "serve", *flags, env=NO_STORAGE_ENV)
    assert out.returncode == 0, out.stderr
    assert [w for w in json.loads(out.stdout)["warnings"] if said in w]
    assert [ln for ln in out.stderr.splitlines() if ln.startswith(f"cachemgr: warning: {said}")]
    out = cli("--root", root, "fingerprint", "--", "sglang", "serve", *flags)
    assert out.returncode == 0 and f"cachemgr: warning: {said}" in out.stderr, out.stderr
    # `true` stands in for the server: exec runs it once init is done
    ran = cli_process("--root", root, "exec", "--", "true", *flags, env=NO_STORAGE_ENV)
    assert ran.returncode == 0 and f"cachemgr: warning: {said}" in ran.stderr, ran.stderr
