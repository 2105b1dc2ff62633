"""--quantization-param-path: SGLang stores FP8 KV divided by the file's scales, so the
file's content (not its path) is part of the identity whenever SGLang would load it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from cachemgr.errors import ConfigError
from cachemgr.identity.record import diff_identities
from cachemgr.sglang.kvscales import EXTERNAL_MODELS_ENV
from cachemgr.sglang.record import Identity
from tests.nsfixtures import cli, cli_process, one_line_error
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
    # DSA: fp8 on SM100 (Muse Spark's `auto` is always fp8, and its class takes no scales:
    # test_scales_on_a_model_class_without_their_loader_are_refused)
    dsa = make_model(
        tmp_path / "dsa",
        extra_config={"architectures": ["DeepseekV32ForCausalLM"], "index_topk": 2048},
    )
    assert ident(f"--model-path {dsa} {flag}").ns_id != ident(f"--model-path {dsa}").ns_id
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


def arch_model(tmp_path: Path, *archs: str) -> Path:
    return make_model(tmp_path / "-".join(archs), extra_config={"architectures": list(archs)})


def test_scales_on_a_model_class_without_their_loader_are_refused(tmp_path: Path) -> None:
    """load_model_utils.py `load_kv_cache_scales` raises for an fp8_e4m3 KV cache with a
    scales file when the model class has no load_kv_cache_scales: SGLang never starts, so
    the launch is refused before init instead of getting a namespace."""
    path = scales_file(tmp_path / "scales.json", 0.5)
    flag = f"--quantization-param-path {path}"
    refused = {
        "MixtralForCausalLM": "SGLang's MixtralForCausalLM cannot load",
        "NoSuchForCausalLM": "the Transformers backend (NoSuchForCausalLM) cannot load",
    }
    for arch, says in refused.items():
        with pytest.raises(ConfigError, match=re.escape(says)):
            fp8(arch_model(tmp_path, arch), flag)
    muse = arch_model(tmp_path, "MuseSparkForConditionalGeneration")  # `auto` is fp8 there
    with pytest.raises(ConfigError, match="MuseSparkForConditionalGeneration cannot load"):
        ident(f"--model-path {muse} {flag}")
    # the class of the first architecture the registry serves loads them (LlamaForCausalLM's
    # subclasses too), and no other KV dtype reads the file
    assert fp8(arch_model(tmp_path, "NoSuchForCausalLM", "LlamaForCausalLM"), flag).kv_cache_scales
    assert fp8(arch_model(tmp_path, "MistralForCausalLM"), flag).kv_cache_scales
    mixtral = tmp_path / "MixtralForCausalLM"
    assert ident(f"--model-path {mixtral} --kv-cache-dtype bfloat16 {flag}").kv_cache_scales is None
    # an external model package may register any class: not refused
    external = f"env {EXTERNAL_MODELS_ENV}=my_models sglang serve --model-path {mixtral}"
    assert ident(f"{external} --kv-cache-dtype fp8_e4m3 {flag}").kv_cache_scales


def test_a_refused_scales_launch_keeps_the_good_namespace(tmp_path: Path) -> None:
    """init made a namespace for it and purged the instance's good one, for a server that
    never started."""
    mixtral = arch_model(tmp_path, "MixtralForCausalLM")
    path = scales_file(tmp_path / "scales.json", 0.5)
    launch = ["sglang", "serve", *CMD.split()[2:], "--model-path", str(mixtral)]
    launch += ["--kv-cache-dtype", "fp8_e4m3"]
    root = str(tmp_path / "root")
    good = cli("--root", root, "init", "--json", "--", *launch, env=NO_STORAGE_ENV)
    assert good.returncode == 0, good.stderr
    out = cli(
        "--root",
        root,
        "init",
        "--",
        *launch,
        "--quantization-param-path",
        str(path),
        env=NO_STORAGE_ENV,
    )
    assert out.returncode == 2 and "cannot load KV cache scaling factors" in one_line_error(out)
    assert Path(json.loads(good.stdout)["storage_dir"]).is_dir()
    again = cli("--root", root, "init", "--json", "--", *launch, env=NO_STORAGE_ENV)
    assert json.loads(again.stdout)["outcome"] == "unchanged"


def test_the_model_override_picks_the_class_that_loads_the_scales(tmp_path: Path) -> None:
    """SGLang sets --json-model-override-args on the config (hf_transformers/config.py
    get_config) before the registry picks the class: its `architectures` decides."""
    path = scales_file(tmp_path / "scales.json", 0.5)
    flag = f"--quantization-param-path {path}"

    def override(arch: str) -> str:
        return f"""--json-model-override-args '{{"architectures": ["{arch}"]}}'"""

    mixtral, llama = (
        arch_model(tmp_path, "MixtralForCausalLM"),
        arch_model(tmp_path, "LlamaForCausalLM"),
    )
    assert fp8(mixtral, flag, override("LlamaForCausalLM")).kv_cache_scales
    with pytest.raises(ConfigError, match="SGLang's MixtralForCausalLM cannot load"):
        fp8(llama, flag, override("MixtralForCausalLM"))
    # `auto` is fp8 (and reads the file) for a DeepSeek DSA config the override makes
    dsa = '{"architectures": ["DeepseekV32ForCausalLM"], "index_topk": 2048}'
    auto = ident(f"--model-path {llama} {flag} --json-model-override-args '{dsa}'")
    assert auto.kv_cache_scales


def test_a_backend_without_the_scales_loader_is_refused(tmp_path: Path) -> None:
    """--model-impl transformers (or mindspore) builds its backend's class over the
    registry's (model_loader/utils.py get_model_architecture): none loads the scales."""
    path = scales_file(tmp_path / "scales.json", 0.5)
    llama = arch_model(tmp_path, "LlamaForCausalLM")
    flag = f"--quantization-param-path {path}"
    assert fp8(llama, flag, "--model-impl sglang").kv_cache_scales
    says = {
        "transformers": "the Transformers backend (LlamaForCausalLM, --model-impl transformers)",
        "mindspore": "SGLang's MindSporeForCausalLM (--model-impl mindspore)",
    }
    for impl, said in says.items():
        with pytest.raises(ConfigError, match=re.escape(said)):
            fp8(llama, flag, f"--model-impl {impl}")
    assert ident(f"--model-path {llama} {flag} --model-impl transformers").kv_cache_scales is None


def test_the_draft_class_must_load_the_scales_too(tmp_path: Path) -> None:
    """A draft runner (EAGLE, standalone, DFLASH, …) calls load_kv_cache_scales with the
    server's KV dtype and scales file (model_runner.py load_model), and SGLang refuses to start
    when its class has none: cachemgr had checked only EAGLE/EAGLE3/STANDALONE drafts."""
    path = scales_file(tmp_path / "scales.json", 0.5)
    llama = arch_model(tmp_path, "LlamaForCausalLM")
    mixtral = make_model(tmp_path / "draft", extra_config={"architectures": ["MixtralForCausalLM"]})
    draft = f"--quantization-param-path {path} --speculative-draft-model-path {mixtral}"
    with pytest.raises(ConfigError, match="the draft model's class, SGLang's MixtralForCausalLM,"):
        fp8(llama, draft, "--speculative-algorithm EAGLE")
    assert fp8(llama, draft, "--speculative-algorithm NGRAM").kv_cache_scales  # no draft runner
    override = """--json-model-override-args '{"architectures": ["LlamaForCausalLM"]}'"""
    assert fp8(llama, draft, "--speculative-algorithm STANDALONE", override).kv_cache_scales
    # DFLASH, DSPARK and FROZEN_KV_MTP build their draft's runner the same way
    # (draft_worker_common.py build_draft_tp_worker); DFlashDraftModel has no scales loader
    dflash = make_model(tmp_path / "dflash", extra_config={"architectures": ["DFlashDraftModel"]})
    spec = f"--quantization-param-path {path} --speculative-draft-model-path {dflash}"
    for algorithm in ("DFLASH", "FROZEN_KV_MTP", "my_plugin_algo"):
        with pytest.raises(ConfigError, match="the draft model's class, SGLang's DFlashDraftModel"):
            fp8(llama, spec, f"--speculative-algorithm {algorithm}")
    assert fp8(llama, spec, "--speculative-algorithm UNO").kv_cache_scales  # no draft model
    # a draft architecture SGLang renames to its MTP/NextN class is not judged by its name
    ds = make_model(tmp_path / "ds", extra_config={"architectures": ["DeepseekV3ForCausalLM"]})
    renamed = f"--quantization-param-path {path} --speculative-draft-model-path {ds}"
    assert fp8(llama, renamed, "--speculative-algorithm EAGLE").kv_cache_scales
