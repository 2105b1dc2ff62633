"""The vLLM settings whose values no argparse choices check, read as vLLM reads them: the KV
layout and the other environment variables that change what a block's bytes mean,
--quantization and --load-format.

A layout vLLM refuses is refused here, before anything is purged: `VLLM_KV_CACHE_LAYOUT=hnd`
must not cost the good cache for a server that will not start. So is a quantization method or
load format vLLM does not ship (`-q fp88`), unless init is told a plugin registers it: plugins
register at the server's start (vLLM's `vllm.general_plugins` entry points run
register_quantization_config, register_model_loader), which cachemgr cannot see without
running vLLM. The lists are generated from vLLM's code (scripts/gen_vllm_flags.py).
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from cachemgr.canonical import canonical_json
from cachemgr.errors import ConfigError
from cachemgr.vllm.flags import (
    DEPRECATED_QUANTIZATION,
    KV_LAYOUT_ALIASES,
    KV_LAYOUTS,
    LOAD_FORMATS,
    QUANTIZATION_METHODS,
    VLLM_VERSION,
)

KV_LAYOUT_ENV = "VLLM_KV_CACHE_LAYOUT"
# Variables vLLM 0.34 reads whose values change an offloaded block's bytes (its shape, byte
# layout, or the attention backend that settles the KV layout), which neither vLLM's folder
# name nor another identity component says (docs/vllm.md, "The identity"):
# VLLM_MLA_DISABLE: an MLA model (DeepSeek, Kimi, …) caches full K/V heads instead of its latent
#   (ModelConfig.use_mla, get_head_size), under the same layer names;
# VLLM_SSM_CONV_STATE_LAYOUT: a hybrid model's Mamba conv state, which the tier offloads, as
#   (dim, state_len) instead of (state_len, dim) (mamba_utils.get_conv_state_layout);
# VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT: AITER's shuffled KV layout (rocm_aiter_fa.py);
# VLLM_BATCH_INVARIANT, VLLM_ROCM_USE_AITER(_MHA, _MLA): which attention backend the platform
#   picks when no flag names one (attention/selector.py, platforms/rocm.py
#   _get_backend_priorities), and with it the KV layout, as `attention` records a flag's.
# VLLM_HUMMING_ONLINE_QUANT_CONFIG, VLLM_HUMMING_INPUT_QUANT_CONFIG: how the humming kernels
#   quantize the weights and activations (humming.py), which changes the K/V computed as -q does;
#   so do VLLM_FP8_MOE_REQUANT(_ACT) (block-FP8 experts requantized to MXFP4, fp8.py) and
#   VLLM_ROCM_MUSE_MOE_ONLINE_QUANT (Muse Spark's experts quantized online).
# Each is read as envs.py reads it; what vLLM's default reads as is left out (an unset one and
# one set to its default are one identity, the one launches had before it was recorded).
_INT_SWITCHES = ("VLLM_MLA_DISABLE", "VLLM_BATCH_INVARIANT")  # bool(int(value)), default 0
# os.getenv(NAME, default).lower() in ("true", "1"), and their defaults
_TRUE_SWITCHES = {
    "VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT": False,
    "VLLM_ROCM_USE_AITER": False,
    "VLLM_ROCM_USE_AITER_MHA": True,
    "VLLM_ROCM_USE_AITER_MLA": True,
}
CONV_LAYOUT_ENV = "VLLM_SSM_CONV_STATE_LAYOUT"
_JSON_CONFIGS = ("VLLM_HUMMING_ONLINE_QUANT_CONFIG", "VLLM_HUMMING_INPUT_QUANT_CONFIG")
REQUANT_ENV = "VLLM_FP8_MOE_REQUANT"
REQUANT_ACT_ENV = "VLLM_FP8_MOE_REQUANT_ACT"
MUSE_QUANT_ENV = "VLLM_ROCM_MUSE_MOE_ONLINE_QUANT"
_CONV_LAYOUTS = ("SD", "DS")  # env_with_choices, case-sensitive; unset reads as SD
# vLLM reads NHD as LBNHC and HND as LBHNC (config/cache.py): one layout, one identity. The
# identity keeps the old name, the only one older vLLM took, so those namespaces keep their id.
_LAYOUT_IDENTITY = {new: old for old, new in KV_LAYOUT_ALIASES.items()}


def kv_cache_layout(raw: str | None) -> str | None:
    """VLLM_KV_CACHE_LAYOUT as the identity keeps it: None when unset, a layout's old name
    for its new one; ConfigError for what vLLM's envs.py refuses (case-sensitive, "" too)."""
    if raw is None:
        return None
    if raw not in KV_LAYOUTS:
        raise ConfigError(
            f"invalid {KV_LAYOUT_ENV}={raw!r}: vLLM {VLLM_VERSION} accepts "
            f"{', '.join(KV_LAYOUTS)} (case-sensitive), or leave it unset"
        )
    return _LAYOUT_IDENTITY.get(raw, raw)


def int_env(name: str, raw: str) -> int:
    """A variable vLLM's envs.py reads with int(): the ConfigError its start ends in for
    anything else, set but empty too (its engine reads every VLLM_ variable as it starts)."""
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"invalid {name}={raw!r}: vLLM takes an integer (0 or 1), or leave it unset"
        ) from None


def kv_environment(env: Mapping[str, str]) -> dict[str, str] | None:
    """The variables of `env` (the server's) that change a block's meaning and are set to
    other than vLLM's default, as the identity keeps them ("1"/"0", the conv layout, canonical
    JSON); None when there is none. ConfigError for a value vLLM's start would end in."""
    out: dict[str, str] = {}
    for name in _INT_SWITCHES:
        if name in env and int_env(name, env[name]):
            out[name] = "1"
    for name, default in _TRUE_SWITCHES.items():
        on = env.get(name, str(default)).lower() in ("true", "1")
        if on != default:
            out[name] = "1" if on else "0"
    conv = _choice(env, CONV_LAYOUT_ENV, _CONV_LAYOUTS, case_sensitive=True)
    if conv not in (None, _CONV_LAYOUTS[0]):
        out[CONV_LAYOUT_ENV] = conv
    # fp8.py requantizes only for the value spelled exactly so (its check ignores case)
    if _choice(env, REQUANT_ENV, ("none", "mxfp4"), case_sensitive=False) == "mxfp4":
        out[REQUANT_ENV] = "mxfp4"
    act = _choice(env, REQUANT_ACT_ENV, ("a8w4", "a4w4", "a16w4"), case_sensitive=False)
    if act is not None and act.lower() != "a8w4":  # fp8_requant.py lowercases it
        out[REQUANT_ACT_ENV] = act.lower()
    muse = env.get(MUSE_QUANT_ENV, "").lower()  # envs.py lowercases it; no check
    if muse:
        out[MUSE_QUANT_ENV] = muse
    for name in _JSON_CONFIGS:
        if name in env:
            out[name] = canonical_json(_json_env(name, env[name]), ensure_ascii=True)
    return out or None


def _choice(
    env: Mapping[str, str], name: str, choices: tuple[str, ...], *, case_sensitive: bool
) -> str | None:
    """The variable as given, None if unset; ConfigError for one envs.py's env_with_choices
    refuses."""
    raw = env.get(name)
    fold = (lambda v: v) if case_sensitive else str.lower
    if raw is None or fold(raw) in {fold(c) for c in choices}:
        return raw
    case = "case-sensitive" if case_sensitive else "any case"
    raise ConfigError(
        f"invalid {name}={raw!r}: vLLM {VLLM_VERSION} accepts {', '.join(choices)} ({case}), "
        "or leave it unset"
    )


def _json_env(name: str, raw: str) -> Any:
    """envs.py `maybe_convert_json_str_or_file`: the JSON in the file `raw` names if there is
    one (its content, so an edit counts), else `raw` itself; ConfigError where vLLM fails."""
    try:
        if os.path.exists(raw):
            with open(raw, encoding="utf-8") as f:
                return json.load(f)
        return json.loads(raw)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConfigError(
            f"invalid {name}={raw!r:.80}: vLLM reads JSON or a JSON file's path ({e})"
        ) from None


def quantization(raw: str | None, allow_deprecated: bool = False) -> str | None:
    """--quantization as vLLM runs it: lowercased (ModelConfig's validator), so `-q FP8` is
    `-q fp8`; a deprecated method without --allow-deprecated-quantization is the ConfigError
    vLLM's start would end in (the launch must not cost the good cache first)."""
    quant = None if raw is None else raw.lower()
    if quant in DEPRECATED_QUANTIZATION and not allow_deprecated:
        raise ConfigError(
            f"--quantization {quant} is deprecated: vLLM {VLLM_VERSION} refuses it without "
            "--allow-deprecated-quantization"
        )
    return quant


def load_format(raw: str) -> str:
    """--load-format as vLLM runs it: lowercased (LoadConfig's validator)."""
    return raw.lower()


def check_shipped(
    quant: str | None,
    load: str,
    plugin_values: frozenset[str],
    declared: Callable[[], str | None],
) -> None:
    """The ConfigError vLLM's start ends in for a --quantization or --load-format it does not
    ship, unless `plugin_values` (init's --plugin-value) names it: a typo must not cost the
    good cache first.

    On a checkpoint that declares its own quantization (`declared`: its method, None if none)
    vLLM's override classes map the launch's value first (ModelConfig._verify_quantization):
    only AutoGPTQ and AutoAWQ take a value vLLM does not ship, `marlin` for their checkpoints
    (as auto_gptq, auto_awq on a GPU); a few claim the checkpoint whatever the value (ModelOpt,
    auto-round, GPT-OSS MXFP4, DeepSeek-V4 FP8) and run their own method in its place. So any
    other such value is refused: vLLM either refuses the mismatch or runs a method other than
    the one the identity would record."""
    plugins = frozenset(v.lower() for v in plugin_values)  # as the launch's value is read
    if quant is not None and quant not in QUANTIZATION_METHODS and quant not in plugins:
        method = declared()
        if method is None:
            _shipped("--quantization", quant, QUANTIZATION_METHODS, "quantization method", plugins)
        elif not (quant == "marlin" and method in ("gptq", "awq")):
            raise ConfigError(
                f"--quantization {quant!r} is not a method vLLM {VLLM_VERSION} ships"
                f"{_nearest(quant, QUANTIZATION_METHODS)}, and the checkpoint declares "
                f"{method or 'its own'}: vLLM refuses the mismatch or runs the checkpoint's "
                f"method in its place, never {quant}; drop the flag (vLLM then reads the "
                f"checkpoint's), or pass --plugin-value {quant} if a plugin registers it"
            )
    _shipped("--load-format", load, LOAD_FORMATS, "load format", plugins)


def _nearest(value: str, known: frozenset[str]) -> str:
    near = difflib.get_close_matches(value, sorted(known), n=3)
    return f" (nearest: {', '.join(near)})" if near else ""


def _shipped(
    flag: str, value: str | None, known: frozenset[str], what: str, plugins: frozenset[str]
) -> None:
    if value is None or value in known or value in plugins:
        return
    raise ConfigError(
        f"{flag} {value!r} is not a {what} vLLM {VLLM_VERSION} ships{_nearest(value, known)}: "
        f"vLLM refuses to start unless a plugin registers it; if one does, pass --plugin-value "
        f"{value}"
    )
