"""The identity of a vLLM server's fs-tier blocks: what vLLM's own folder digest leaves out.

vLLM (0.33.0, 0.34.0) names a folder by a digest of the model name, KV dtype, block sizes, parallel
sizes and layer names (kv_offload/file_mapper.py). It leaves out the weights' content, the
revision, quantization, `--hf-overrides` (RoPE), `max_model_len`, the KV layout when it is
not canonical, the environment variables that change a block's shape or layout, the block
hash algorithm and the vLLM version (docs/vllm.md): a change of any of them keeps the folder
and serves stale blocks. This record holds them all; its namespace dir becomes the tier's
`root_dir`, so any change moves the server to a new one.

The record carries `"engine": "vllm"`: readers of a manifest pick the file format from it
(absent: SGLang, whose record schema is untouched).
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable, Mapping
from typing import ClassVar, Literal

import xxhash
from pydantic import BaseModel, ConfigDict

from cachemgr.canonical import canonical_json
from cachemgr.errors import IdentityError
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
from cachemgr.identity.record import Digested, Weights
from cachemgr.vllm.args import VllmLaunchArgs
from cachemgr.vllm.flags import VLLM_VERSION

_FROZEN = ConfigDict(frozen=True, extra="forbid")
MODELSCOPE_ENV = "VLLM_USE_MODELSCOPE"


class VllmTopology(BaseModel):
    """How the KV is cut across ranks (data-parallel replicas share blocks: no dp_size)."""

    model_config = _FROZEN
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1


class VllmSource(BaseModel):
    """Where the values came from; informative, not part of the digest."""

    model_config = ConfigDict(frozen=True, extra="allow")
    model_path: str  # as given: vLLM's folder name is made of it
    model_dir: str
    served_model_name: str
    kv_cache_dtype_arg: str = "auto"
    root_dir_arg: str | None = None  # the fs tier's root_dir in the launch, before cachemgr's
    vllm_version: str | None = None
    vllm_version_from: Literal["option", "installed", "unknown", "namespace"] = "unknown"


class VllmIdentity(Digested):
    """An immutable, versioned identity record of a vLLM server's fs tier."""

    model_config = ConfigDict(frozen=True, extra="ignore")  # ignore: digest/ns_id are derived
    ENGINE: ClassVar[str] = "vllm"
    VERSION_FIELD: ClassVar[str] = "vllm_version"
    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset(
        {
            "hf_config",
            "attention",
            "environment",
            "kv_cache_dtype_skip_layers",
            "quantization_config",
            "mamba_cache_dtype",
            "mamba_ssm_cache_dtype",
        }
    )

    engine: Literal["vllm"] = "vllm"
    schema_version: Literal[1] = 1
    weights: Weights
    revision: str | None = None
    dtype: str
    kv_cache_dtype: str
    # --kv-cache-dtype-skip-layers, sorted: the layers whose KV is stored unquantized, in a block
    # vLLM's folder name does not tell from a quantized one's; None without the flag
    kv_cache_dtype_skip_layers: list[str] | None = None
    # --mamba-cache-dtype, --mamba-ssm-cache-dtype: the dtype of a hybrid model's offloaded
    # Mamba state, which vLLM's folder name does not say; None: auto (the model's own, which
    # its config in `weights` says)
    mamba_cache_dtype: str | None = None
    mamba_ssm_cache_dtype: str | None = None
    # None: the platform's default (CUDA: 64 in vLLM 0.34, 16 before), not known here
    block_size: int | None
    kv_cache_layout: str  # VLLM_KV_CACHE_LAYOUT; "default" when unset
    # The other VLLM_* variables that change a block's bytes (an MLA model's KV shape, the Mamba
    # conv state's or ROCm's KV layout, the platform's attention backend), those set to other
    # than vLLM's default (values.kv_environment); None when none is
    environment: dict[str, str] | None = None
    topology: VllmTopology
    quantization: str | None = None
    # --quantization-config: how an online quantization quantizes each kind of layer (canonical
    # JSON), which changes the weights the KV is computed with as -q does; None without it
    quantization_config: str | None = None
    hf_overrides: str | None = None  # canonical JSON
    # xxh3-128 of the model config --hf-config-path names, which vLLM reads instead of the
    # model dir's (the weights' record hashes that one); None without the flag
    hf_config: str | None = None
    # The attention backend(s) and hisparse, as given (argcheck.attention): with them vLLM may
    # settle on another KV layout, which its folder name does not say (no canonical layout).
    # None when left to vLLM: the platform then picks the same on every start.
    attention: str | None = None
    max_model_len: int | None = None  # None: the model's own
    prefix_caching_hash_algo: str = "sha256"
    load_format: str | None = None  # only when it does not load the model dir's weights
    vllm_version: str
    salt: str = ""
    source: VllmSource


def installed_vllm_version() -> str | None:
    """The version of an importable `vllm` distribution, if one is installed here."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def run_dtype(dtype_arg: str, config: Mapping[str, object]) -> str:
    """The model dtype: the flag, else the checkpoint's (vLLM's `auto`)."""
    if dtype_arg.lower() != "auto":
        return normalize_dtype(dtype_arg)
    found = model_dir.config_dtype(config)
    return normalize_dtype(found) if found else "unknown"


def _unless_auto(value: str) -> str | None:
    return None if value == "auto" else value


def _config_digest(config: Mapping[str, object]) -> str:
    """A model config's content (key order and spacing do not count), as 32 hex digits."""
    text = canonical_json(config, ensure_ascii=False)
    return xxhash.xxh3_128_hexdigest(text.encode())


def modelscope(env: Mapping[str, str]) -> str | None:
    """The variable that makes vLLM fetch repo ids from ModelScope, if `env` sets it true (as
    envs.py reads it)."""
    on = env.get(MODELSCOPE_ENV, "").strip().lower() in ("1", "true")
    return MODELSCOPE_ENV if on else None


def model_hub(args: VllmLaunchArgs, env: Mapping[str, str]) -> model_dir.Hub:
    """Where the server started with `args` from `env` finds a repo id's files."""
    return model_dir.Hub(env, args.download_dir, modelscope(env))


def compute_vllm_identity(
    args: VllmLaunchArgs,
    options: IdentityOptions | None = None,
    *,
    cache: DigestCache | None = None,
    env: Mapping[str, str] = os.environ,
    progress: ProgressFactory | None = None,
    installed: Callable[[], str | None] = installed_vllm_version,
) -> VllmIdentity:
    """The identity of a vLLM server started with `args`, its model files read from disk."""
    opts = options or IdentityOptions()
    server_env = {**env, **args.launch_env}  # as launchenv.server_environ builds it
    if model_dir.gguf_file(args.model) is not None:
        # vLLM has no GGUF load format, and its get_config finds no config in a file
        # (transformers_utils/config.py): only a model that reads the file itself (Flint,
        # with --hf-config-path) could serve one; cachemgr does not follow that far.
        raise IdentityError(
            f"model path {args.model} is a single GGUF file: vLLM {VLLM_VERSION} has no GGUF "
            "loader, pass a model directory (cachemgr reads single GGUF files for SGLang)"
        )
    hub = model_hub(args, server_env)
    directory = model_dir.locate_model(args.model, args.revision, hub)
    # vLLM's ModelConfig: get_config(hf_config_path or model, revision=…)
    config_dir = directory
    if args.hf_config_path is not None:
        config_dir = model_dir.locate_model(args.hf_config_path, args.revision, hub)
    config = model_dir.read_json(config_dir / "config.json")
    own_config = (
        config if config_dir == directory else model_dir.read_json(directory / "config.json")
    )
    dtype = run_dtype(args.dtype, config)
    # vLLM's `auto` KV dtype is the model dtype (offloading/config.py); an explicit one is
    # kept as written, as vLLM's own digest keeps it (fp8 and fp8_e4m3 are two folders).
    kv = dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    version, full, version_from = engine_version(
        opts.engine_version, opts.version_granularity, installed
    )
    weights = model_weights(
        directory, opts, cache=cache, progress=progress, code=args.trust_remote_code
    )
    return VllmIdentity(
        weights=weights,
        revision=args.revision,
        dtype=dtype,
        kv_cache_dtype=kv,
        kv_cache_dtype_skip_layers=sorted(set(args.kv_cache_dtype_skip_layers)) or None,
        mamba_cache_dtype=_unless_auto(args.mamba_cache_dtype),
        mamba_ssm_cache_dtype=_unless_auto(args.mamba_ssm_cache_dtype),
        block_size=args.block_size,
        kv_cache_layout=args.kv_cache_layout or "default",
        environment=args.kv_environment,
        topology=VllmTopology(
            tp_size=args.tensor_parallel_size,
            pp_size=args.pipeline_parallel_size,
            pcp_size=args.prefill_context_parallel_size,
            dcp_size=args.decode_context_parallel_size,
        ),
        quantization=args.quantization,
        quantization_config=args.quantization_config,
        hf_overrides=args.hf_overrides,
        hf_config=None if config == own_config else _config_digest(config),
        attention=args.attention,
        max_model_len=args.max_model_len,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        load_format=None if args.load_format in WEIGHT_LOAD_FORMATS else args.load_format,
        vllm_version=version,
        salt=opts.salt,
        source=VllmSource(
            model_path=args.model,
            model_dir=str(directory),
            served_model_name=args.served_model_name or args.model,
            kv_cache_dtype_arg=args.kv_cache_dtype,
            root_dir_arg=args.tier.root_dir if args.tier else None,
            vllm_version=full,
            vllm_version_from=version_from,
        ),
    )
