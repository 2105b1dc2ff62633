"""The vLLM settings whose values no argparse choices check, read as vLLM reads them: the KV
layout (an environment variable), --quantization and --load-format.

A layout vLLM refuses is refused here, before anything is purged: `VLLM_KV_CACHE_LAYOUT=hnd`
must not cost the good cache for a server that will not start. A quantization method or load
format vLLM does not ship is only warned about: a plugin may register it, and cachemgr cannot
see plugins. The lists are generated from vLLM's code (scripts/gen_vllm_flags.py).
"""

from __future__ import annotations

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


def plugin_warnings(quant: str | None, load: str) -> list[str]:
    """A quantization method or load format vLLM does not ship: vLLM refuses it at start
    unless a plugin registers it, which cachemgr cannot see, so it is said, not refused."""
    said = []
    if quant is not None and quant not in QUANTIZATION_METHODS:
        said.append(
            f"--quantization {quant!r} is not a quantization method vLLM {VLLM_VERSION} "
            "knows: it must come from a plugin, or vLLM will refuse to start"
        )
    if load not in LOAD_FORMATS:
        said.append(
            f"--load-format {load!r} is not a load format vLLM {VLLM_VERSION} knows: "
            "it must come from a plugin, or vLLM will refuse to start"
        )
    return said
