"""Read the settings that matter to the cache out of a vLLM launch command.

`vllm serve <model> …` or `python -m vllm.entrypoints.openai.api_server --model <model> …`:
the command goes through vLLM's argv rewrites (cachemgr.vllm.argv) and then the flag table
generated from vLLM's parser (cachemgr.vllm.flags), read as its argparse reads them (unique
prefixes included); every other flag vLLM knows is skipped, one it does not know refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cachemgr.argprefix import read_option
from cachemgr.canonical import canonical_json
from cachemgr.errors import ConfigError
from cachemgr.vllm import argcheck
from cachemgr.vllm import values as vllm_values
from cachemgr.vllm.argv import ReadConfig, VllmCommand, prepass, read_yaml_config, split_vllm
from cachemgr.vllm.flags import ALIASES, MULTI_VALUE, NO_VALUE, OPTIONS, VLLM_VERSION
from cachemgr.vllm.tier import FsTier, Offloading, fs_tier

# The KV layout is an environment variable, not a flag (vllm/envs.py).
KV_LAYOUT_ENV = vllm_values.KV_LAYOUT_ENV
SIMPLE_OFFLOAD_ENV = "VLLM_USE_SIMPLE_KV_OFFLOAD"  # with --kv-offloading-size: its simple connector


class VllmLaunchArgs(BaseModel):
    """What a vLLM server will run with; defaults are vLLM 0.34.0's (engine/arg_utils.py;
    0.33.0's are the same)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(min_length=1)
    revision: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    # A hybrid model's Mamba state, which the tier offloads beside the KV (both states, then
    # the SSM state alone); auto: the model's, then mamba_cache_dtype's (config/cache.py)
    # Layers (indices, or `sliding_window`) whose KV vLLM keeps unquantized (attention.py: their
    # kv_cache_dtype becomes auto), as a set: vLLM tests membership
    kv_cache_dtype_skip_layers: tuple[str, ...] = ()
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    # None: the platform picks (CUDA: 64 in vLLM 0.34, 16 before)
    block_size: int | None = Field(None, ge=1)
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    decode_context_parallel_size: int = Field(1, ge=1)
    prefill_context_parallel_size: int = Field(1, ge=1)
    max_model_len: int | None = None  # None: from the model's config (absent, auto, -1)
    hf_overrides: str | None = None  # canonical JSON
    hf_config_path: str | None = None  # the model config vLLM reads instead of the model dir's
    attention: str | None = None  # what of the attention flags decides the KV layout (JSON)
    quantization: str | None = None
    quantization_config: str | None = None  # canonical JSON
    prefix_caching_hash_algo: str = "sha256"
    served_model_name: str | None = None
    load_format: str = "auto"
    download_dir: str | None = None
    trust_remote_code: bool = False
    allow_deprecated_quantization: bool = False  # (not in the identity: it only lets vLLM start)
    # VLLM_KV_CACHE_LAYOUT, from the launch or environment; an alias as its old name (NHD, HND)
    kv_cache_layout: str | None = None
    # The other variables that change a block's meaning, set to other than vLLM's default
    # (values.kv_environment); None when there is none.
    kv_environment: dict[str, str] | None = None
    kv_transfer_config: str | None = None  # canonical JSON
    # Not a flag: the `VAR=value` assignments in front of the program (`env HF_HOME=… vllm
    # serve …`), which the server's environment has on top of the one it is started from.
    launch_env: dict[str, str] = Field(default_factory=dict)
    tier: FsTier | None = None  # the fs secondary tier of --kv-transfer-config, if any


# Long flag (after the pre-pass: dashes) → VllmLaunchArgs field; short ones via ALIASES.
FLAGS: dict[str, str] = {
    "--model": "model",
    "--revision": "revision",
    "--dtype": "dtype",
    "--kv-cache-dtype": "kv_cache_dtype",
    "--kv-cache-dtype-skip-layers": "kv_cache_dtype_skip_layers",
    "--mamba-cache-dtype": "mamba_cache_dtype",
    "--mamba-ssm-cache-dtype": "mamba_ssm_cache_dtype",
    "--block-size": "block_size",
    "--tensor-parallel-size": "tensor_parallel_size",
    "--pipeline-parallel-size": "pipeline_parallel_size",
    "--decode-context-parallel-size": "decode_context_parallel_size",
    "--prefill-context-parallel-size": "prefill_context_parallel_size",
    "--max-model-len": "max_model_len",
    "--hf-overrides": "hf_overrides",
    "--hf-config-path": "hf_config_path",
    # Not in the record as given: argcheck.attention reads what of them decides the KV layout.
    "--attention-backend": "attention_backend",
    "--attention-config": "attention_config",
    "--quantization": "quantization",
    "--quantization-config": "quantization_config",
    "--prefix-caching-hash-algo": "prefix_caching_hash_algo",
    "--kv-transfer-config": "kv_transfer_config",
    "--served-model-name": "served_model_name",
    "--load-format": "load_format",
    "--download-dir": "download_dir",
    "--trust-remote-code": "trust_remote_code",
    "--no-trust-remote-code": "trust_remote_code",
    "--allow-deprecated-quantization": "allow_deprecated_quantization",
    "--no-allow-deprecated-quantization": "allow_deprecated_quantization",
    # Not in the record: with a size, vLLM replaces the config's connector (cachemgr.vllm.tier).
    "--kv-offloading-size": "kv_offloading_size",
    "--kv-offloading-backend": "kv_offloading_backend",
}
FLAG_OF = {f: flag for flag, f in reversed(FLAGS.items())} | {"model": "model"}
# Fields of a multi-value flag whose every value counts (the others keep the first)
ALL_VALUES = frozenset({"kv_cache_dtype_skip_layers"})
ENGINE = f"vLLM {VLLM_VERSION}"


def _is_value(tok: str) -> bool:
    return read_option(tok, OPTIONS, ENGINE) is None


def scan_flags(args: Sequence[str], serve: bool) -> dict[str, str | bool | list[str]]:
    """The known flags of pre-passed `args` and their raw values, the last occurrence winning
    (as argparse); `vllm serve`'s first positional is the model. Each token is read as vLLM's
    argparse reads it: a unique prefix is its flag; an ambiguous prefix, a flag vLLM lacks, or
    a word no flag takes (a second positional) is a ConfigError."""
    found: dict[str, str | bool | list[str]] = {}
    i = 1 if serve else 0  # skip the `serve` subcommand
    positionals = False  # after `--`, as argparse reads it
    while i < len(args):
        tok = args[i]
        i += 1
        if tok == "--" and not positionals:
            positionals = True
            continue
        option = None if positionals else read_option(tok, OPTIONS, ENGINE)
        if option is None:
            if not serve or "model_tag" in found:
                raise ConfigError(
                    f"unrecognized argument {tok!r}: {ENGINE} refuses it (no flag takes it)"
                )
            found["model_tag"] = tok  # argparse: the first positional
            continue
        name = ALIASES.get(option.name, option.name)
        values: list[str] = []
        if option.explicit is not None:
            values.append(option.explicit)
        elif name not in NO_VALUE and i < len(args) and _is_value(args[i]):
            values.append(args[i])
            i += 1
            while name in MULTI_VALUE and i < len(args) and _is_value(args[i]):
                values.append(args[i])  # --served-model-name a b: the first one names it
                i += 1
        if name in FLAGS:
            field = FLAGS[name]
            value: str | bool | list[str] = values[0] if values else True
            if name.startswith("--no-"):
                value = False
            elif field in ALL_VALUES and values:
                value = values
            found[field] = value
    return found


def is_vllm_launch(command: Sequence[str]) -> bool:
    """Whether a launch command starts vLLM (`vllm serve`, the api_server module)."""
    return split_vllm(command) is not None


def resolve_vllm_args(
    command: Sequence[str],
    environ: dict[str, str] | None = None,
    read_config: ReadConfig = read_yaml_config,
) -> VllmLaunchArgs:
    """VllmLaunchArgs from a vLLM launch command; ConfigError for what vLLM would refuse."""
    cmd = split_vllm(command)
    if cmd is None:
        raise ConfigError(
            "not a vLLM launch (expected `vllm serve …` or `python -m "
            "vllm.entrypoints.openai.api_server …`)"
        )
    values: dict[str, Any] = dict(scan_flags(prepass(cmd, NO_VALUE, read_config), cmd.serve))
    positional = values.pop("model_tag", None)
    if positional is not None:
        values["model"] = positional  # serve.py: model_tag wins over --model
    argcheck.check(values, FLAG_OF)
    if not values.get("model"):
        raise ConfigError("no model: `vllm serve <model> …` (or --model for the api_server)")
    values["max_model_len"] = argcheck.max_model_len(values.get("max_model_len"))
    values["hf_overrides"] = argcheck.hf_overrides(values.get("hf_overrides"))
    values["quantization_config"] = argcheck.quantization_config(values.get("quantization_config"))
    values["attention"] = argcheck.attention(
        values.pop("attention_backend", None), values.pop("attention_config", None)
    )
    config = argcheck.kv_transfer_config(values.get("kv_transfer_config"))
    values["tier"] = fs_tier(config, _offloading(values, cmd, environ or {}))
    values["kv_transfer_config"] = (
        None if config is None else canonical_json(config, ensure_ascii=True)
    )
    values["kv_cache_layout"] = vllm_values.kv_cache_layout(
        _env_value(cmd, environ or {}, KV_LAYOUT_ENV)
    )
    values["kv_environment"] = vllm_values.kv_environment({**(environ or {}), **cmd.env})
    values["quantization"] = vllm_values.quantization(
        values.get("quantization"), bool(values.get("allow_deprecated_quantization"))
    )
    values["load_format"] = vllm_values.load_format(values.get("load_format", "auto"))
    values["launch_env"] = dict(cmd.env)
    try:
        return VllmLaunchArgs(**values)
    except ValidationError as e:
        first = e.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "?"
        raise ConfigError(
            f"invalid {FLAG_OF.get(field, field)} {first.get('input')!r}: {first['msg']}"
        ) from None


def _offloading(values: dict[str, Any], cmd: VllmCommand, environ: dict[str, str]) -> Offloading:
    """--kv-offloading-size/-backend (taken out of `values`) and VLLM_USE_SIMPLE_KV_OFFLOAD."""
    size = values.pop("kv_offloading_size", None)
    backend = values.pop("kv_offloading_backend", "native")
    raw = _env_value(cmd, environ, SIMPLE_OFFLOAD_ENV)
    # vLLM's envs.py: bool(int(os.getenv(NAME, "0"))): set but empty fails its start too,
    # with or without an offloading size.
    simple = 0 if raw is None else vllm_values.int_env(SIMPLE_OFFLOAD_ENV, raw)
    return Offloading(size, backend, bool(simple))


def _env_value(cmd: VllmCommand, environ: dict[str, str], name: str) -> str | None:
    """A variable as the server gets it: set in the launch (`env A=1 vllm …`) or inherited;
    set but empty is "", not None (vLLM refuses an empty VLLM_KV_CACHE_LAYOUT and
    VLLM_USE_SIMPLE_KV_OFFLOAD)."""
    return cmd.env.get(name, environ.get(name))
