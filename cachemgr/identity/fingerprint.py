"""Compute the identity of the server a launch command describes."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from cachemgr.errors import IdentityError
from cachemgr.identity import hashing, model_dir
from cachemgr.identity.digest_cache import DigestCache
from cachemgr.identity.hashing import FileStat
from cachemgr.identity.record import (
    FILE_KEY_SCHEME,
    FileDigest,
    Identity,
    Source,
    Storage,
    Topology,
)
from cachemgr.identity.record import Weights as WeightsRecord
from cachemgr.sglang.args import LaunchArgs

# Architectures whose SGLang model overrides (arg_groups/model_overrides/*.py) set page_size
# from the GPU or attention backend, sometimes over an explicit --page-size.
PAGE_SIZE_OVERRIDING_ARCHS = frozenset(
    """
    MiniMaxM3SparseForCausalLM MiniMaxM3SparseForConditionalGeneration
    Qwen3VLForConditionalGeneration Qwen3VLMoeForConditionalGeneration
    NemotronHForCausalLM NemotronHPuzzleForCausalLM DeepseekV4ForCausalLM
    DeepseekV32ForCausalLM DeepseekV3ForCausalLM Dots3NoteForCausalLM
    Glm5NextForConditionalGeneration GlmMoeDsaForCausalLM HYV4ForCausalLM HYV4ForCausalLMNextN
    KimiK25ForConditionalGeneration LongcatFlashForCausalLM LongcatFlashForCausalLMNextN
    MistralLarge3ForCausalLM PixtralForConditionalGeneration
    InternS2MobiusForConditionalGeneration InternS2PreviewForConditionalGeneration
    Qwen3NextForCausalLM Qwen3_5ForConditionalGeneration Qwen3_5MoeForConditionalGeneration
    Qwen4ExpForConditionalGeneration
    """.split()  # noqa: SIM905
)
# --load-format values that load the model dir's own weights (arg_groups/choices.py); any
# other (dummy: random weights, remote*, private, flash_rl, newer ones) is in the identity.
WEIGHT_LOAD_FORMATS = frozenset(
    """
    auto pt safetensors instanttensor npcache sharded_state presharded gguf expert_pack
    bitsandbytes mistral layered fastsafetensors runai_streamer
    """.split()  # noqa: SIM905
)
PageSizeFrom = Literal["flag", "attention_backend", "server"]
VersionGranularity = Literal["major.minor", "full", "none"]
# Opens a progress display for a number of bytes to hash; yields the per-chunk callback.
ProgressFactory = Callable[[int], AbstractContextManager[hashing.Progress | None]]

# SGLang's dtype spellings (model_config.py _STR_DTYPE_TO_TORCH_DTYPE, kv_cache_dtype.py).
_DTYPE_NAMES = {
    "bf16": "bfloat16",
    "half": "float16",
    "fp16": "float16",
    "float": "float32",
    "fp32": "float32",
    "fp8_e4m3fn": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
}


class IdentityOptions(BaseModel):
    """The operator's knobs on how an identity is computed."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    salt: str = ""
    fast: bool = False
    sglang_version: str | None = None  # explicit; else the installed sglang, else "unknown"
    vllm_version: str | None = None  # the same for a vLLM launch
    version_granularity: VersionGranularity = "major.minor"
    hash_workers: int = 0  # 0: hashing.default_workers()


def normalize_dtype(name: str) -> str:
    """One spelling per dtype, so `bf16` and `bfloat16` are the same identity."""
    low = name.strip().lower().removeprefix("torch.")
    return _DTYPE_NAMES.get(low, low)


def model_dtype(dtype_arg: str, config: Mapping[str, Any]) -> str:
    """The dtype SGLang runs the model in (model_config.py `_get_and_verify_dtype`)."""
    if dtype_arg.lower() != "auto":
        return normalize_dtype(dtype_arg)
    found = model_dir.config_dtype(config)
    if found is None or normalize_dtype(found) == "float32":
        # SGLang serves float32 (or dtype-less) checkpoints in half precision; gemma in bf16.
        return "bfloat16" if str(config.get("model_type", "")).startswith("gemma") else "float16"
    return normalize_dtype(found)


def kv_dtype(kv_arg: str, run_dtype: str, quant_kv_algo: str | None) -> str:
    """The KV cache dtype (mem_cache/kv_cache_dtype.py `configure_kv_cache_dtype`, CUDA)."""
    if kv_arg.lower() != "auto":
        return normalize_dtype(kv_arg)
    if quant_kv_algo is not None and quant_kv_algo.upper() == "FP8":
        return "fp8_e4m3"  # the checkpoint carries FP8 KV scales and `auto` adopts them
    return run_dtype


def installed_sglang_version() -> str | None:
    """The version of an importable `sglang` distribution, if one is installed here."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def sglang_version(
    explicit: str | None,
    granularity: VersionGranularity,
    installed: Callable[[], str | None] = installed_sglang_version,
) -> tuple[str, str | None, Literal["option", "installed", "unknown"]]:
    """(identity value, full version, where it came from)."""
    full = explicit or installed()
    origin: Literal["option", "installed", "unknown"] = (
        "option" if explicit else "installed" if full else "unknown"
    )
    if granularity == "none":
        return "any", full, origin
    if full is None:
        return "unknown", None, origin
    return (".".join(full.split(".")[:2]) if granularity == "major.minor" else full), full, origin


def page_size(args: LaunchArgs, config: Mapping[str, Any]) -> tuple[int | None, PageSizeFrom]:
    """(page size, where it comes from); None when SGLang resolves it on the GPU.

    An explicit backend's forcing is applied last by SGLang, so it is always known. Without
    the flag, the default backend (trtllm_mha on SM100) may force 64; a model with page-size
    overrides may rewrite even the flag — then the flag's value stays in the identity (the
    operator's intent) but is not held against the server.
    """
    if args.page_size_source == "attention_backend":
        return args.page_size, "attention_backend"
    if args.page_size_source == "default":
        return None, "server"
    archs = config.get("architectures")
    if isinstance(archs, list) and PAGE_SIZE_OVERRIDING_ARCHS & {str(a) for a in archs}:
        return args.page_size, "server"
    return args.page_size, "flag"


@contextlib.contextmanager
def _no_progress(_total: int) -> Iterator[hashing.Progress | None]:
    yield None


def digest_weights(
    directory: Path,
    *,
    fast: bool = False,
    cache: DigestCache | None = None,
    workers: int = 0,
    progress: ProgressFactory | None = None,
    code: bool = False,
) -> WeightsRecord:
    """Digest every identity file of a model dir, reusing cached digests of unchanged files."""
    names = model_dir.identity_files(directory, code=code)
    real = {name: Path(os.path.realpath(directory / name)) for name in names}
    stats = {name: hashing.stat_regular(directory / name) for name in names}
    for name, st in stats.items():
        if st.size == 0:
            raise IdentityError(f"{directory / name} is empty (0 bytes): an interrupted download?")
    algo = hashing.ALGO_FAST if fast else hashing.ALGO_FULL
    keyed: dict[str, FileStat] = {str(real[n]): stats[n] for n in names}
    known = cache.lookup(algo, keyed) if cache is not None else {}
    todo = sorted({real[n] for n in names if str(real[n]) not in known})
    todo_bytes = sum(keyed[str(p)].size for p in todo)
    with (progress or _no_progress)(todo_bytes) as tick:
        fresh = hashing.hash_files(todo, fast=fast, workers=workers, progress=tick)
    if cache is not None and fresh:
        cache.record(algo, {str(p): (h.stat, h.digest) for p, h in fresh.items()})
    digests = known | {str(p): h.digest for p, h in fresh.items()}
    sizes = keyed | {str(p): h.stat for p, h in fresh.items()}
    files = tuple(
        FileDigest(name=n, size=sizes[str(real[n])].size, digest=digests[str(real[n])])
        for n in names
    )
    return WeightsRecord(mode="fast" if fast else "full", algo=algo, files=files)


def _tp_lcm_size(args: LaunchArgs) -> int | None:
    """`tp_lcm_size` from --hicache-storage-backend-extra-config (cache_controller.py)."""
    value = args.extra_config.get("tp_lcm_size")
    return int(value) if value is not None else None


def _override_args(raw: str) -> str | None:
    """--json-model-override-args as canonical JSON (key order and spaces don't count)."""
    try:
        data = json.loads(raw or "{}")
    except json.JSONDecodeError:
        raise IdentityError(f"--json-model-override-args is not JSON: {raw!r}") from None
    if not data:
        return None
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def compute_identity(
    args: LaunchArgs,
    options: IdentityOptions | None = None,
    *,
    cache: DigestCache | None = None,
    env: Mapping[str, str] = os.environ,
    progress: ProgressFactory | None = None,
    installed: Callable[[], str | None] = installed_sglang_version,
) -> Identity:
    """The identity of a server started with `args`, its model files read from disk."""
    opts = options or IdentityOptions()

    def weights(directory: Path) -> WeightsRecord:
        return digest_weights(
            directory, fast=opts.fast, cache=cache, workers=opts.hash_workers, progress=progress,
            code=args.trust_remote_code,
        )  # fmt: skip

    target_dir = model_dir.locate_model(args.model_path, args.revision, env=env)
    config = model_dir.read_json(target_dir / "config.json")
    run_dtype = model_dtype(args.dtype, config)
    kv = kv_dtype(args.kv_cache_dtype, run_dtype, model_dir.kv_cache_quant_algo(target_dir, config))
    draft_dir = draft_kv = draft_weights = None
    if args.speculative_draft_model_path:
        draft_dir = model_dir.locate_model(
            args.speculative_draft_model_path, args.speculative_draft_model_revision, env=env
        )
        draft_config = model_dir.read_json(draft_dir / "config.json")
        # spec.py: the draft's KV dtype follows --kv-cache-dtype unless set on its own.
        draft_kv = kv_dtype(
            args.speculative_draft_kv_cache_dtype or args.kv_cache_dtype,
            model_dtype(args.dtype, draft_config),
            model_dir.kv_cache_quant_algo(draft_dir, draft_config),
        )
        draft_weights = weights(draft_dir)
    page, page_from = page_size(args, config)
    version, full_version, version_from = sglang_version(
        opts.sglang_version, opts.version_granularity, installed
    )
    return Identity(
        weights=weights(target_dir),
        draft_weights=draft_weights,
        kv_cache_dtype=kv,
        draft_kv_cache_dtype=draft_kv,
        dtype=run_dtype,
        quantization=args.quantization,
        draft_quantization=args.speculative_draft_model_quantization if draft_dir else None,
        page_size=page,
        hicache_mem_layout=args.hicache_mem_layout,
        topology=Topology(
            tp_size=args.tp_size,
            pp_size=args.pp_size,
            attn_dp_size=args.attn_dp_size,
            attn_cp_size=args.attn_cp_size,
            dcp_size=args.dcp_size,
        ),
        mamba_ssm_dtype=normalize_dtype(args.mamba_ssm_dtype) if args.mamba_ssm_dtype else None,
        model_override_args=_override_args(args.json_model_override_args),
        load_format=None if args.load_format in WEIGHT_LOAD_FORMATS else args.load_format,
        page_major_kv_layout=args.enable_page_major_kv_layout or args.enable_unified_memory,
        sglang_version=version,
        storage=Storage(
            key_scheme=FILE_KEY_SCHEME,
            tp_lcm_size=_tp_lcm_size(args),
        ),
        salt=opts.salt,
        source=Source(
            model_path=args.model_path,
            model_dir=str(target_dir),
            served_model_name=args.model_name,
            draft_model_path=args.speculative_draft_model_path,
            draft_model_dir=str(draft_dir) if draft_dir else None,
            kv_cache_dtype_arg=args.kv_cache_dtype,
            storage_backend=args.hicache_storage_backend,
            sglang_version=full_version,
            sglang_version_from=version_from,
            page_size_from=page_from,
        ),
    )
