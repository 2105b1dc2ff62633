"""The identity of an SGLang server: its launch settings resolved as SGLang resolves them."""

from __future__ import annotations

import importlib.metadata
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from cachemgr.canonical import canonical_json
from cachemgr.errors import ConfigError, IdentityError
from cachemgr.identity import model_dir
from cachemgr.identity.digest_cache import DigestCache
from cachemgr.identity.fingerprint import (
    WEIGHT_LOAD_FORMATS,
    IdentityOptions,
    ProgressFactory,
    engine_version,
    model_weights,
    normalize_dtype,
)
from cachemgr.identity.record import Weights as WeightsRecord
from cachemgr.sglang.args import LaunchArgs
from cachemgr.sglang.kvscales import (
    NO_DRAFT_MODEL_ALGORITHMS,
    check_scales_loadable,
    kv_cache_scales,
)
from cachemgr.sglang.record import FILE_KEY_SCHEME, Identity, Source, Storage, Topology

MODELSCOPE_ENV = "SGLANG_USE_MODELSCOPE"
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
PageSizeFrom = Literal["flag", "attention_backend", "server"]
# Speculative algorithms whose draft keeps no KV of its own in HiCache: those without a draft
# model, and FROZEN_KV_MTP, whose draft reads the target's (speculative/base_spec_worker.py
# `_draft_model_runners`). Any other, a plugin's too, may pack draft layers into the pages.
NO_DRAFT_KV_ALGORITHMS = NO_DRAFT_MODEL_ALGORITHMS | {"FROZEN_KV_MTP"}
DSPARK_DRAFT_SUBFOLDER = "dspark"  # speculative_hook.py `_target_checkpoint_dspark_subfolder`
# dspark_config.py `checkpoint_bundles_dspark_draft`: the target's config marks a bundled draft
DSPARK_BUNDLE_KEYS = (
    "dspark_block_size",
    "dspark_markov_rank",
    "dspark_noise_token_id",
    "dspark_target_layer_ids",
)
GGUF_LOAD_FORMATS = frozenset({"auto", "gguf"})  # those that load a .gguf model path as GGUF


def model_dtype(dtype_arg: str, config: Mapping[str, Any] | None) -> str:
    """The dtype SGLang runs the model in (model_config.py `_get_and_verify_dtype`); `auto`
    as is when the config is in a GGUF file's own metadata (None), which cachemgr does not
    read: such a launch never shares a namespace with a dtype the server may not run."""
    if dtype_arg.lower() != "auto":
        return normalize_dtype(dtype_arg)
    if config is None:
        return "auto"
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


def modelscope(env: Mapping[str, str]) -> str | None:
    """The variable that makes SGLang fetch repo ids from ModelScope, if `env` sets it true (as
    environ.py's EnvBool reads it; the loader's get_bool_env_var takes a subset)."""
    on = env.get(MODELSCOPE_ENV, "").lower() in ("true", "1", "yes", "y")
    return MODELSCOPE_ENV if on else None


def model_hub(args: LaunchArgs, env: Mapping[str, str]) -> model_dir.Hub:
    """Where the server started with `args` from `env` finds a repo id's files."""
    return model_dir.Hub(env, args.download_dir, modelscope(env))


def locate_target(args: LaunchArgs, env: Mapping[str, str]) -> Path:
    """The model dir, or the single GGUF file SGLang serves as one: with --load-format auto or
    gguf it makes such a file's load format and quantization gguf (arg_groups/
    model_path_hook.py `handle_load_format`, overrides.py `_gguf_quantization`) and
    GGUFModelLoader reads it (model_loader/loader.py); `env` is the server's."""
    target = _locate(args.model_path, args.revision, args.load_format, model_hub(args, env))
    _refuse_gguf_dir("--model-path", args.model_path, target, args.load_format)
    return target


def locate_draft(args: LaunchArgs, target: Path, env: Mapping[str, str]) -> Path | None:
    """The draft model's dir or GGUF file, None without one. Its runner loads it with
    --speculative-draft-load-format, else with the target's load format as resolved: gguf for a
    GGUF target (model_runner.py `_resolve_draft_load_format`, load_model_utils.py
    LoadConfig); only gguf reads a .gguf draft (the default loader takes its path for a repo
    id and fails)."""
    path = args.speculative_draft_model_path
    if not path:
        return None
    load_format = args.speculative_draft_load_format or (
        "gguf" if target.is_file() else args.load_format
    )
    hub = model_hub(args, env)
    # Located as GGUF whatever its load format, to say what to change for a .gguf draft.
    draft = _locate(path, args.speculative_draft_model_revision, "gguf", hub)
    if draft.is_file() and load_format != "gguf":
        raise ConfigError(
            f"--speculative-draft-model-path {path} is a GGUF file, which SGLang does not load "
            f"with load format {load_format}: add --speculative-draft-load-format gguf"
        )
    _refuse_gguf_dir("--speculative-draft-model-path", path, draft, load_format)
    return draft


def _refuse_gguf_dir(flag: str, path: str, located: Path, load_format: str) -> None:
    """ConfigError for a model dir loaded as GGUF: GGUFModelLoader takes one file and fails
    the server's start on anything else (model_loader/loader.py `_prepare_weights`), which init
    would otherwise have purged the instance's namespace for."""
    if load_format == "gguf" and not located.is_file():
        raise ConfigError(
            f"{flag} {path} is a directory, and SGLang's GGUF loader (load format gguf) takes "
            "one .gguf file, so it would fail to start: pass the file (or owner/repo/<file>.gguf)"
        )


def default_draft(args: LaunchArgs, target: Path, config: Mapping[str, Any]) -> Path | None:
    """The draft SGLang loads for a speculative launch that names none: the target itself for
    the EAGLE/NextN MTP models (speculative_hook.py `_handle_eagle_family` defaults the path to
    the model's), or for DSPARK a draft bundled in it, else its `dspark/` subfolder
    (`_handle_dspark`); None with a draft path, without speculation, or for an algorithm whose
    draft stores no KV. Such a draft's layers are packed into the target's HiCache pages
    (base_spec_worker.py `_can_pack_hicache_mtp`): a page then holds more layers per token, and
    a server without the draft reads another's page as its own (the file backend reads the
    first bytes of a longer file), so the draft must be in the identity."""
    algorithm = (args.speculative_algorithm or "").upper()
    if args.speculative_draft_model_path or not algorithm or algorithm in NO_DRAFT_KV_ALGORITHMS:
        return None
    subfolder = target / DSPARK_DRAFT_SUBFOLDER
    bundled = any(config.get(key) is not None for key in DSPARK_BUNDLE_KEYS)
    if algorithm == "DSPARK" and not bundled and (subfolder / "config.json").is_file():
        return subfolder
    return target


def _locate(path: str, revision: str | None, load_format: str, hub: model_dir.Hub) -> Path:
    """A model path as a server loading it with `load_format` reads it: a Hub reference to a
    .gguf is that file first (model_path_hook.py `resolve_hf_gguf_model_path`, for the target
    and the draft alike, before any load format is looked at)."""
    resolved = str(model_dir.hub_gguf(path, revision, hub) or path)
    gguf = model_dir.gguf_file(resolved) if load_format in GGUF_LOAD_FORMATS else None
    return gguf or model_dir.locate_model(resolved, revision, hub)


def target_config(target: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(config.json, its KV quantization algo) of a model dir or GGUF file, the target's or
    the draft's; None for the config of a GGUF file without a config.json beside it (then it
    is in the file's metadata). A GGUF file's quantization (GGUFConfig) has no KV
    quantization."""
    if not target.is_file():
        config = model_dir.read_json(target / "config.json")
        return config, model_dir.kv_cache_quant_algo(target, config)
    beside = target.parent / "config.json"
    return (model_dir.read_json(beside) if beside.is_file() else None), None


def installed_sglang_version() -> str | None:
    """The version of an importable `sglang` distribution, if one is installed here."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


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


def _tp_lcm_size(args: LaunchArgs) -> int | None:
    """`tp_lcm_size` from --hicache-storage-backend-extra-config (cache_controller.py). SGLang
    takes the JSON value as is into `tp_lcm_size % tp_size`: a string fails the server's start
    and a fraction its assertion, so anything but a whole number is refused here."""
    value = args.extra_config.get("tp_lcm_size")
    if value is None:
        return None
    if isinstance(value, bool | float) and float(value).is_integer():
        return int(value)  # (8.0 % 4 == 0: SGLang runs with it; false is skipped, true is 1)
    if not value and isinstance(value, str | list | dict):
        return None  # `if tp_lcm_size:`: SGLang skips an empty one
    if not isinstance(value, int):
        raise IdentityError(
            "tp_lcm_size in --hicache-storage-backend-extra-config must be a whole number,"
            f" not {json.dumps(value)[:40]}"
        )
    return value


def _override_data(raw: str) -> Any:
    """--json-model-override-args as SGLang reads it (model_config.py: json.loads)."""
    try:
        return json.loads(raw or "{}")
    except json.JSONDecodeError:
        raise IdentityError(f"--json-model-override-args is not JSON: {raw!r}") from None


def _override_args(raw: str) -> str | None:
    """--json-model-override-args as canonical JSON (key order and spaces don't count)."""
    data = _override_data(raw)
    if not data:
        return None
    return canonical_json(data, ensure_ascii=False)


def hf_config(config: Mapping[str, Any], args: LaunchArgs) -> dict[str, Any]:
    """The model's config as SGLang serves it: --json-model-override-args set on it key by key
    (utils/hf_transformers/config.py `get_config`), so an overridden `architectures` picks the
    model class. A top-level update: what is read from it here (architectures, index_topk) is
    top-level."""
    data = _override_data(args.json_model_override_args)
    return {**config, **data} if isinstance(data, dict) else dict(config)


def compute_identity(
    args: LaunchArgs,
    options: IdentityOptions | None = None,
    *,
    cache: DigestCache | None = None,
    env: Mapping[str, str] = os.environ,
    progress: ProgressFactory | None = None,
    installed: Callable[[], str | None] = installed_sglang_version,
) -> Identity:
    """The identity of a server started with `args`, its model files read from disk.

    `env` is the environment the server is started from; the launch's own `VAR=…` prefix
    (`args.launch_env`) is on top of it, as the server sees it.
    """
    opts = options or IdentityOptions()
    server_env = {**env, **args.launch_env}  # as launchenv.server_environ builds it

    def weights(directory: Path) -> WeightsRecord:
        return model_weights(
            directory, opts, cache=cache, progress=progress, code=args.trust_remote_code
        )

    target = locate_target(args, server_env)
    read_config, quant_kv_algo = target_config(target)
    config = hf_config(read_config or {}, args)
    # The draft's runner has the same load config: --download-dir is its cache too.
    draft_dir = locate_draft(args, target, server_env) or default_draft(args, target, config)
    draft_config, draft_kv_algo = target_config(draft_dir) if draft_dir else (None, None)
    # Before the weights are hashed; the draft's config gets the same overrides
    # (model_config.py `from_server_args`).
    draft_hf = None if draft_config is None else hf_config(draft_config, args)
    check_scales_loadable(args, config, server_env, draft_hf)
    run_dtype = model_dtype(args.dtype, read_config)
    kv = kv_dtype(args.kv_cache_dtype, run_dtype, quant_kv_algo)
    target_weights = weights(target)
    draft_kv = draft_weights = None
    if draft_dir is not None:
        # spec.py: the draft's KV dtype follows --kv-cache-dtype unless set on its own.
        draft_kv = kv_dtype(
            args.speculative_draft_kv_cache_dtype or args.kv_cache_dtype,
            model_dtype(args.dtype, draft_config),
            draft_kv_algo,
        )
        draft_weights = target_weights if draft_dir == target else weights(draft_dir)
    page, page_from = page_size(args, config)
    version, full_version, version_from = engine_version(
        opts.engine_version, opts.version_granularity, installed
    )
    return Identity(
        weights=target_weights,
        draft_weights=draft_weights,
        kv_cache_dtype=kv,
        draft_kv_cache_dtype=draft_kv,
        kv_cache_scales=kv_cache_scales(args, config),
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
            model_dir=str(target),
            served_model_name=args.model_name,
            draft_model_path=args.speculative_draft_model_path,
            draft_model_dir=str(draft_dir) if draft_dir else None,
            kv_cache_dtype_arg=args.kv_cache_dtype,
            kv_cache_scales_path=args.quantization_param_path,
            storage_backend=args.hicache_storage_backend,
            sglang_version=full_version,
            sglang_version_from=version_from,
            page_size_from=page_from,
        ),
    )
