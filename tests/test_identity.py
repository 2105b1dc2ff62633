"""Identities of real model directories: what changes the digest and what must not."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from cachemgr.engines import record_file
from cachemgr.errors import IdentityError
from cachemgr.identity.digest_cache import DigestCache
from cachemgr.identity.fingerprint import IdentityOptions
from cachemgr.identity.fingerprint import engine_version as sglang_version
from cachemgr.identity.hashing import Progress
from cachemgr.identity.record import diff_identities
from cachemgr.layout import NS_ID_RE
from cachemgr.sglang.args import resolve_launch_args
from cachemgr.sglang.identity import compute_identity
from cachemgr.sglang.record import Identity
from cachemgr.state.store import Store

HOUR_AGO = time.time() - 3600
NO_ENV: dict[str, str] = {}


def make_model(
    path: Path,
    shards: int = 3,
    seed: int = 0,
    dtype: str = "bfloat16",
    order: range | None = None,
    extra_config: dict[str, object] | None = None,
) -> Path:
    """A small real checkpoint: safetensors shards, config.json, and files that don't count."""
    path.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    tensors = [rng.standard_normal((32, 16)).astype(np.float32) for _ in range(shards)]
    for i in order or range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({f"layers.{i}.weight": tensors[i]}, str(path / name))
    config = {"model_type": "qwen3", "torch_dtype": dtype, **(extra_config or {})}
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    (path / "generation_config.json").write_text('{"temperature": 0.6}')
    (path / "README.md").write_text("# a model\n")
    age(path)
    return path


def age(path: Path) -> None:
    """Backdate every file, as a model downloaded earlier would be (see RACY_SECONDS)."""
    for entry in path.iterdir():
        os.utime(entry, (HOUR_AGO, HOUR_AGO), follow_symlinks=False)


def ident(command: str, opts: IdentityOptions | None = None, **kw: object) -> Identity:
    return compute_identity(
        resolve_launch_args(command), opts or IdentityOptions(engine_version="0.5.23"), **kw
    )  # type: ignore[arg-type]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return make_model(tmp_path / "model")


def shard(model: Path, i: int) -> Path:
    return next(model.glob(f"model-{i:05d}-of-*.safetensors"))


def test_digest_is_stable_and_not_path_or_order_dependent(model: Path, tmp_path: Path) -> None:
    copy = make_model(tmp_path / "elsewhere" / "copy", order=range(2, -1, -1))
    a, b = ident(f"--model-path {model}"), ident(f"--model-path {model}")
    c = ident(f"--model-path {copy}")
    assert a.digest == b.digest == c.digest
    assert a.source.model_dir != c.source.model_dir
    assert len(a.digest) == 32 and NS_ID_RE.fullmatch(a.ns_id) and a.digest.startswith(a.ns_id)


def test_record_round_trips_through_json(model: Path, tmp_path: Path) -> None:
    a = ident(f"--model-path {model} --kv-cache-dtype fp8_e4m3 --page-size 64")
    (tmp_path / "rec.json").write_text(a.model_dump_json())
    (tmp_path / "manifest.json").write_text(json.dumps({"identity": a.model_dump(mode="json")}))
    assert record_file(tmp_path / "rec.json").digest == a.digest
    assert record_file(tmp_path / "manifest.json") == a


def test_any_weight_byte_changes_the_digest(model: Path) -> None:
    before = ident(f"--model-path {model}")
    path = shard(model, 2)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # one bit of one tensor value
    path.write_bytes(bytes(data))
    age(model)
    after = ident(f"--model-path {model}")
    assert after.digest != before.digest
    assert diff_identities(before, after) == ["weights: model-00002-of-00003.safetensors changed"]


def test_shard_added_removed_renamed(model: Path) -> None:
    base = ident(f"--model-path {model}")
    extra = model / "model-extra.safetensors"
    save_file({"x": np.ones(4, np.float32)}, str(extra))
    age(model)
    added = ident(f"--model-path {model}")
    assert diff_identities(base, added) == ["weights: model-extra.safetensors added"]
    extra.unlink()
    assert ident(f"--model-path {model}").digest == base.digest
    shard(model, 3).unlink()
    removed = ident(f"--model-path {model}")
    assert diff_identities(base, removed) == ["weights: model-00003-of-00003.safetensors removed"]
    shard(model, 1).rename(model / "model-00009.safetensors")
    renamed = ident(f"--model-path {model}")
    assert renamed.digest not in (base.digest, removed.digest)
    assert diff_identities(removed, renamed) == [
        "weights: model-00001-of-00003.safetensors renamed to model-00009.safetensors"
    ]


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        ("--kv-cache-dtype fp8_e4m3", "kv_cache_dtype: bfloat16 → fp8_e4m3"),
        ("--page-size 64", "page_size: none → 64"),
        ("--hicache-mem-layout layer_first", "hicache_mem_layout: page_first → layer_first"),
        ("--tp-size 2", "topology.tp_size: 1 → 2"),
        ("--mamba-ssm-dtype float32", "mamba_ssm_dtype: none → float32"),
        ("--quantization fp8", "quantization: none → fp8"),
        ("--dtype float16", "dtype: bfloat16 → float16"),
        (
            """--json-model-override-args '{"rope_scaling": {"factor": 4.0}}'""",
            'model_override_args: none → {"rope_scaling":{"factor":4.0}}',
        ),
        ("--load-format dummy", "load_format: none → dummy"),
        ("--load-format remote_instance", "load_format: none → remote_instance"),
        ("--enable-page-major-kv-layout", "page_major_kv_layout: False → True"),
        ("--enable-unified-memory", "page_major_kv_layout: False → True"),
    ],
)
def test_settings_that_change_page_bytes_change_the_digest(
    model: Path, flags: str, line: str
) -> None:
    base = ident(f"sglang serve --model-path {model}")
    changed = ident(f"sglang serve --model-path {model} {flags}")
    assert changed.digest != base.digest
    assert line in diff_identities(base, changed)


def test_unrelated_flags_do_not_change_the_digest(model: Path) -> None:
    base = ident(f"sglang serve --model-path {model}")
    other = ident(
        f"python -m sglang.launch_server --model-path {model} --host 0.0.0.0 --port 31000 "
        "--log-level debug --mem-fraction-static 0.5 --served-model-name other-name "
        "--enable-metrics --hicache-storage-backend-extra-config '{\"metadata_ttl\": 9}' "
        "--load-format safetensors --json-model-override-args '{}' --trust-remote-code"
    )
    assert other.digest == base.digest
    assert other.source.served_model_name == "other-name"  # recorded, but not identity


def test_bf16_spellings_and_auto_agree(model: Path) -> None:
    auto = ident(f"--model-path {model}")
    assert auto.kv_cache_dtype == "bfloat16" and auto.source.kv_cache_dtype_arg == "auto"
    assert ident(f"--model-path {model} --kv-cache-dtype bf16").digest == auto.digest
    assert ident(f"--model-path {model} --kv-cache-dtype bfloat16").digest == auto.digest


def test_auto_kv_dtype_follows_the_checkpoint(tmp_path: Path) -> None:
    fp32 = make_model(tmp_path / "fp32", dtype="float32")
    assert ident(f"--model-path {fp32}").kv_cache_dtype == "float16"  # SGLang serves it in fp16
    gemma = make_model(tmp_path / "gemma", dtype="float32", extra_config={"model_type": "gemma2"})
    assert ident(f"--model-path {gemma}").kv_cache_dtype == "bfloat16"
    fp8kv = make_model(
        tmp_path / "fp8kv",
        extra_config={"quantization_config": {"quant_method": "fp8", "kv_cache_quant_algo": "FP8"}},
    )
    assert ident(f"--model-path {fp8kv}").kv_cache_dtype == "fp8_e4m3"
    modelopt = make_model(tmp_path / "modelopt")
    (modelopt / "hf_quant_config.json").write_text(
        json.dumps({"quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"}})
    )
    age(modelopt)
    rec = ident(f"--model-path {modelopt}")
    assert rec.kv_cache_dtype == "fp8_e4m3"
    assert "hf_quant_config.json" in [f.name for f in rec.weights.files]


def test_files_that_do_not_shape_pages_are_left_out(model: Path) -> None:
    base = ident(f"--model-path {model}")
    assert [f.name for f in base.weights.files] == [
        "config.json",
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]
    (model / "tokenizer.json").write_text('{"version": "2.0"}')
    (model / "README.md").write_text("changed\n")
    assert ident(f"--model-path {model}").digest == base.digest
    (model / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16", "num_layers": 2}))
    assert ident(f"--model-path {model}").digest != base.digest


def test_draft_weights_count(model: Path, tmp_path: Path) -> None:
    draft = make_model(tmp_path / "draft", shards=1, seed=7)
    cmd = f"--model-path {model} --speculative-draft-model-path {draft}"
    with_draft = ident(cmd)
    assert with_draft.digest != ident(f"--model-path {model}").digest
    assert with_draft.draft_kv_cache_dtype == "bfloat16"
    path = shard(draft, 1)
    data = bytearray(path.read_bytes())
    data[-2] ^= 0xFF
    path.write_bytes(bytes(data))
    age(draft)
    changed = ident(cmd)
    assert diff_identities(with_draft, changed) == [
        "draft_weights: model-00001-of-00001.safetensors changed"
    ]
    own_kv = ident(cmd + " --kv-cache-dtype fp8_e4m3 --speculative-draft-kv-cache-dtype bf16")
    assert (own_kv.kv_cache_dtype, own_kv.draft_kv_cache_dtype) == ("fp8_e4m3", "bfloat16")


def test_salt_and_fast_mode_make_other_identities(model: Path) -> None:
    base = ident(f"--model-path {model}")
    salted = ident(f"--model-path {model}", IdentityOptions(engine_version="0.5.23", salt="x"))
    fast = ident(f"--model-path {model}", IdentityOptions(engine_version="0.5.23", fast=True))
    assert len({base.digest, salted.digest, fast.digest}) == 3
    assert fast.weights.mode == "fast" and fast.weights.algo == "fast-v1"
    assert diff_identities(base, fast) == ["weights.mode: full → fast"]


def test_sglang_version_granularity() -> None:
    def none() -> None:
        return None

    assert sglang_version("0.5.23", "major.minor", none) == ("0.5", "0.5.23", "option")
    assert sglang_version("0.5.23", "full", none) == ("0.5.23", "0.5.23", "option")
    assert sglang_version(None, "major.minor", lambda: "0.5.19") == ("0.5", "0.5.19", "installed")
    assert sglang_version(None, "major.minor", none) == ("unknown", None, "unknown")
    assert sglang_version(None, "none", lambda: "0.5.19")[0] == "any"


def test_patch_releases_share_an_identity_by_default(model: Path) -> None:
    def rec(version: str, gran: str = "major.minor") -> Identity:
        opts = IdentityOptions(engine_version=version, version_granularity=gran)  # type: ignore[arg-type]
        return ident(f"--model-path {model}", opts)

    assert rec("0.5.19").digest == rec("0.5.23").digest != rec("0.6.0").digest
    assert rec("0.5.19", "full").digest != rec("0.5.23", "full").digest


class ByteCounter:
    """A progress factory that records how many bytes each run had to hash."""

    def __init__(self) -> None:
        self.totals: list[int] = []

    @contextlib.contextmanager
    def __call__(self, total: int) -> Iterator[Progress | None]:
        self.totals.append(total)
        yield None


def test_digest_cache_skips_unchanged_files_and_rehashes_touched_ones(
    model: Path, tmp_path: Path
) -> None:
    store = Store.open(tmp_path / "state.db")
    cache, counter = DigestCache(store), ByteCounter()
    first = ident(f"--model-path {model}", cache=cache, progress=counter)
    warm = ident(f"--model-path {model}", cache=cache, progress=counter)
    touched_file = shard(model, 2)
    later = time.time() - 60
    os.utime(touched_file, (later, later))  # `touch`: new mtime, same bytes
    touched = ident(f"--model-path {model}", cache=cache, progress=counter)
    assert first.digest == warm.digest == touched.digest
    assert counter.totals == [first.weights.total_bytes, 0, touched_file.stat().st_size]
    store.close()


def test_hf_cache_snapshot_with_symlinked_blobs(model: Path, tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    repo = hub / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in model.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    age(repo / "blobs")
    env = {"HF_HUB_CACHE": str(hub)}
    plain = ident(f"--model-path {model}")
    by_repo = ident("--model-path org/tiny", env=env)
    by_commit = ident(f"--model-path org/tiny --revision {commit}", env={"HF_HOME": str(tmp_path)})
    assert by_repo.digest == by_commit.digest == plain.digest
    assert by_repo.source.model_dir == str(snap)
    with pytest.raises(IdentityError, match="not in the Hugging Face cache"):
        ident("--model-path org/other", env=env)
    (repo / "blobs" / "blob-model-00002-of-00003.safetensors").unlink()  # interrupted download
    with pytest.raises(IdentityError, match="broken symlink"):
        ident("--model-path org/tiny", env=env)


def test_missing_model_dir(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="model directory /nonexistent/m does not exist"):
        ident("--model-path /nonexistent/m", env=NO_ENV)
    with pytest.raises(IdentityError, match="not in the Hugging Face cache"):
        ident("--model-path org/name", env={"HF_HUB_CACHE": str(tmp_path)})


def test_empty_shard_and_empty_dir(model: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(IdentityError, match="no weight files"):
        ident(f"--model-path {tmp_path / 'empty'}")
    shard(model, 2).write_bytes(b"")
    with pytest.raises(IdentityError, match=r"00002-of-00003.safetensors is empty \(0 bytes\)"):
        ident(f"--model-path {model}")


def test_page_size_origin_is_recorded(tmp_path: Path) -> None:
    plain = make_model(tmp_path / "plain")
    rec = ident(f"--model-path {plain}")
    assert (rec.page_size, rec.source.page_size_from) == (None, "server")
    rec = ident(f"--model-path {plain} --page-size 64")
    assert (rec.page_size, rec.source.page_size_from) == (64, "flag")
    rec = ident(f"--model-path {plain} --attention-backend flashmla")
    assert (rec.page_size, rec.source.page_size_from) == (64, "attention_backend")
    # DeepSeek's model overrides may rewrite even an explicit page size on some GPUs.
    ds = make_model(tmp_path / "ds", extra_config={"architectures": ["DeepseekV3ForCausalLM"]})
    rec = ident(f"--model-path {ds} --page-size 64")
    assert (rec.page_size, rec.source.page_size_from) == (64, "server")


def test_override_args_spelling_does_not_count(model: Path) -> None:
    a = ident(f"""--model-path {model} --json-model-override-args '{{"a": 1, "b": 2}}'""")
    b = ident(f"""--model-path {model} --json-model-override-args '{{"b":2,"a":1}}'""")
    assert a.digest == b.digest


def test_remote_code_counts_only_when_trusted(model: Path) -> None:
    (model / "modeling_tiny.py").write_text("SCALE = 1.0\n")
    (model / "configuration_tiny.py").write_text("X = 1\n")
    untrusted = ident(f"--model-path {model}")
    trusted = ident(f"--model-path {model} --trust-remote-code")
    assert trusted.digest != untrusted.digest
    assert "weights: modeling_tiny.py added" in diff_identities(untrusted, trusted)
    (model / "modeling_tiny.py").write_text("SCALE = 0.5\n")
    assert ident(f"--model-path {model}").digest == untrusted.digest  # code not run
    edited = ident(f"--model-path {model} --trust-remote-code")
    assert diff_identities(trusted, edited) == ["weights: modeling_tiny.py changed"]


def test_a_draft_sglang_defaults_to_is_in_the_identity(model: Path, tmp_path: Path) -> None:
    """`--speculative-algorithm EAGLE` (or NEXTN) on an MTP model loads the target as its draft
    and packs the draft's layers into each HiCache page (a page holds more layers per token);
    the identity had no draft then, so such a server and one without speculation shared a
    namespace, and the one without read the other's longer pages as its own."""
    plain = ident(f"--model-path {model}")
    mtp = ident(f"--model-path {model} --speculative-algorithm EAGLE")
    assert mtp.ns_id != plain.ns_id
    assert (mtp.draft_weights, mtp.source.draft_model_dir) == (mtp.weights, str(model))
    assert ident(f"--model-path {model} --speculative-algorithm NEXTN").ns_id == mtp.ns_id
    fp8_draft = ident(
        f"--model-path {model} --speculative-algorithm EAGLE --speculative-draft-kv-cache-dtype "
        "fp8_e4m3"
    )
    assert fp8_draft.draft_kv_cache_dtype == "fp8_e4m3" and fp8_draft.ns_id != mtp.ns_id
    # no draft KV in HiCache: the launch keeps the namespace it had
    for algorithm in ("NGRAM", "uno", "FROZEN_KV_MTP"):
        spec = ident(f"--model-path {model} --speculative-algorithm {algorithm}")
        assert spec.ns_id == plain.ns_id, algorithm


def test_a_dspark_draft_in_the_checkpoint_is_in_the_identity(model: Path, tmp_path: Path) -> None:
    """DSPARK without a draft path loads the draft bundled in the target (its config's dspark_*
    keys) or from its `dspark/` subfolder, which the target's weights do not cover."""
    draft = make_model(model / "dspark", shards=1, seed=3)
    spec = f"--model-path {model} --speculative-algorithm DSPARK"
    first = ident(spec)
    assert first.source.draft_model_dir == str(draft)
    assert [f.name for f in first.draft_weights.files] == [  # type: ignore[union-attr]
        "config.json",
        "model-00001-of-00001.safetensors",
    ]
    data = bytearray(shard(draft, 1).read_bytes())
    data[-2] ^= 0xFF
    shard(draft, 1).write_bytes(bytes(data))
    age(draft)
    assert ident(spec).ns_id != first.ns_id
    bundled = make_model(tmp_path / "bundled", extra_config={"dspark_block_size": 16})
    (bundled / "dspark").mkdir()
    rec = ident(f"--model-path {bundled} --speculative-algorithm DSPARK")
    assert rec.source.draft_model_dir == str(bundled) and rec.draft_weights == rec.weights
