"""--quantization-param-path: the FP8 KV scaling factors SGLang stores pages with.

With an fp8_e4m3 KV cache, SGLang 0.5.23 loads the file's per-layer scales into each
attention layer's k_scale/v_scale (model_runner_components/load_model_utils.py
`load_kv_cache_scales`) and divides K and V by them before the FP8 store (memory_pool.py), so
the same page bytes mean other values under another file. What the identity holds is the
file's content digest: a moved copy keeps the namespace, an edited file gets a new one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cachemgr.errors import ConfigError, IdentityError
from cachemgr.identity.hashing import ALGO_FULL, hash_file
from cachemgr.sglang.args import LaunchArgs
from cachemgr.sglang.flags import (
    DRAFT_RENAMED_ARCHS,
    KV_SCALES_ARCHS,
    MODEL_ARCHS,
    SGLANG_VERSION,
)

log = logging.getLogger(__name__)

# load_kv_cache_scales reads the file only when the server's kv_cache_dtype is exactly
# "fp8_e4m3". `auto` becomes that for a few models (arg_groups/overrides.py: Muse Spark always,
# DeepSeek DSA on SM100, a GPU only the server knows): for those `auto` counts too (a file the
# server then ignores only costs a namespace of its own); for any other model it never does,
# so such a launch keeps the namespace it had before the scales were read.
SCALED_KV = "fp8_e4m3"
# models/registry.py: a package whose EntryClass classes come first, before SGLang's own
EXTERNAL_MODELS_ENV = "SGLANG_EXTERNAL_MODEL_PACKAGE"
UNREAD = "unread:"  # the prefix of a file cachemgr could not read
AUTO_FP8_ARCHS = frozenset({"MuseSparkForConditionalGeneration"})
# Speculative algorithms without a draft model: every other one (EAGLE, EAGLE3, STANDALONE,
# DFLASH, DSPARK, FROZEN_KV_MTP, a plugin's) loads its draft in a ModelRunner of its own
# (speculative/draft_worker_common.py `build_draft_tp_worker`, frozen_kv_mtp_worker_v2.py).
NO_DRAFT_MODEL_ALGORITHMS = frozenset({"NGRAM", "UNO"})
# configs/model_config.py is_deepseek_dsa: the first architecture, with index_topk set
DSA_ARCHS = frozenset(
    {
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "DeepseekV3ForCausalLMNextN",
        "MistralLarge3ForCausalLM",
        "PixtralForConditionalGeneration",
        "GlmMoeDsaForCausalLM",
        "GlmMoeDsaForCausalLMNextN",
        "Glm5NextForConditionalGenerationNextN",
        "Glm5NextForConditionalGeneration",
        "LongcatFlashForCausalLM",
        "LongcatFlashForCausalLMNextN",
        "Dots3NoteForCausalLM",
        "Dots3NoteForCausalLMNextN",
        "HYV4ForCausalLM",
        "HYV4ForCausalLMNextN",
    }
)


def _architectures(config: Mapping[str, Any]) -> list[str]:
    archs = config.get("architectures")
    return [str(a) for a in archs] if isinstance(archs, list) else []


def _first_arch(config: Mapping[str, Any]) -> str | None:
    return next(iter(_architectures(config)), None)


def _surely_fp8(kv_arg: str, config: Mapping[str, Any]) -> bool:
    """Whether the server runs an fp8_e4m3 KV cache on any GPU."""
    return kv_arg == SCALED_KV or (kv_arg == "auto" and _first_arch(config) in AUTO_FP8_ARCHS)


def _scaled(kv_arg: str, config: Mapping[str, Any]) -> bool:
    """Whether the server may run an fp8_e4m3 KV cache, and so read the scales: surely, or
    DeepSeek DSA's `auto` on the GPUs that make it fp8."""
    dsa = _first_arch(config) in DSA_ARCHS and config.get("index_topk") is not None
    return _surely_fp8(kv_arg, config) or (kv_arg == "auto" and dsa)


def check_scales_loadable(
    args: LaunchArgs,
    config: Mapping[str, Any],
    env: Mapping[str, str],
    draft_config: Mapping[str, Any] | None = None,
) -> None:
    """ConfigError for a launch SGLang refuses to start: an fp8_e4m3 KV cache and a scales
    file on a model class without `load_kv_cache_scales` (load_model_utils.py raises). Said
    before init, which would otherwise purge the instance's namespace for it; `env` is the
    server's environment, `config` the model's as SGLang serves it (overrides applied).

    A draft runner loads its model the same way, with the server's KV dtype and scales file
    (model_runner.py `load_model`), so the draft's class (`draft_config`, None if unread)
    must have the method too. Nothing is refused where that is not certain: a KV dtype only
    the GPU settles, a config without architectures (a GGUF file's are in its metadata), a
    registry an external package fills, a draft architecture SGLang renames.
    """
    fp8 = _surely_fp8(args.kv_cache_dtype, config)
    if args.quantization_param_path is None or not fp8 or env.get(EXTERNAL_MODELS_ENV):
        return
    model = _without_scales_loader(args, _architectures(config))
    if model is None and draft_config is not None and _loads_draft(args):
        model = _draft_without_scales_loader(args, draft_config)
    if model is not None:
        raise ConfigError(
            f"--quantization-param-path with an fp8_e4m3 KV cache: SGLang {SGLANG_VERSION} "
            f"refuses to start, {model} cannot load KV cache scaling factors; drop the flag"
        )


def _without_scales_loader(args: LaunchArgs, archs: list[str]) -> str | None:
    """The class SGLang builds for `archs` when it has no `load_kv_cache_scales`, else None
    (also when `archs` is empty: not known). model_loader/utils.py `get_model_architecture`:
    --model-impl mindspore builds MindSporeForCausalLM, transformers the Transformers
    backend's class, as does an architecture the registry lacks (`resolve_model_cls` takes
    the first it serves)."""
    if not archs:
        return None
    if args.model_impl == "mindspore":
        return "SGLang's MindSporeForCausalLM (--model-impl mindspore)"
    if args.model_impl == "transformers":
        return f"the Transformers backend ({', '.join(archs)}, --model-impl transformers)"
    served = next((a for a in archs if a in MODEL_ARCHS), None)
    if served in KV_SCALES_ARCHS:
        return None
    return f"SGLang's {served}" if served else f"the Transformers backend ({', '.join(archs)})"


def _draft_without_scales_loader(args: LaunchArgs, draft_config: Mapping[str, Any]) -> str | None:
    """The draft's class without `load_kv_cache_scales`, else None; None too for an
    architecture SGLang renames for a draft (its MTP/NextN class may differ)."""
    archs = _architectures(draft_config)
    if DRAFT_RENAMED_ARCHS & set(archs[:1]):
        return None
    model = _without_scales_loader(args, archs)
    return None if model is None else f"the draft model's class, {model},"


def _loads_draft(args: LaunchArgs) -> bool:
    """Whether the speculative algorithm runs the draft model in a ModelRunner of its own
    (TpModelWorker(is_draft_worker=True), whose load_model loads the scales)."""
    algo = (args.speculative_algorithm or "").upper()
    return bool(algo) and algo not in NO_DRAFT_MODEL_ALGORITHMS


def kv_cache_scales(args: LaunchArgs, config: Mapping[str, Any]) -> str | None:
    """The identity's `kv_cache_scales`: the scales file's digest when SGLang would load it,
    None when it would not (no flag, or a KV dtype that takes no scales); `config` is the
    model's config.json.

    SGLang only logs an error for a file it cannot read and runs with scales of 1.0
    (weight_utils.py `kv_cache_scales_loader`), so cachemgr warns instead of refusing
    (`unread_scales_warning`); the value is then `unread:<path>`, never the value of a launch
    without the flag: the server may see a file cachemgr does not (another mount), and its
    pages must not be shared with a launch whose scales are 1.0.
    """
    path = args.quantization_param_path
    if path is None or not _scaled(args.kv_cache_dtype, config):
        return None
    try:
        return f"{ALGO_FULL}:{hash_file(Path(path)).digest}"
    except IdentityError as e:
        log.debug("scales file not read", extra={"error": str(e)})
        return f"{UNREAD}{path}"


def unread_scales_warning(scales: str | None) -> str | None:
    """The warning for an identity's `kv_cache_scales` that records an unread file, else None."""
    if scales is None or not scales.startswith(UNREAD):
        return None
    return (
        f"--quantization-param-path {scales.removeprefix(UNREAD)} is not readable here: SGLang "
        "would run with FP8 KV scaling factors of 1.0 (the identity records the file as unread)"
    )
