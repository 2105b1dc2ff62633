"""Refuse a launch's values the way SGLang's parser would, before anything acts on them.

`flag_of` maps a LaunchArgs field to the flag that sets it, for the message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cachemgr.errors import ConfigError
from cachemgr.sglang.flags import CHOICES, INTEGER, SGLANG_VERSION


def check_types(values: Mapping[str, Any], flag_of: Mapping[str, str]) -> None:
    """A value flag given without a value, or a switch given one, is the operator's error."""
    bool_fields = {
        "enable_dp_attention",
        "enable_hierarchical_cache",
        "disaggregation_decode_enable_offload_kvcache",
        "enable_lmcache",
        "enable_flexkv",
        "trust_remote_code",
        "enable_page_major_kv_layout",
        "enable_unified_memory",
        "enable_eplb",
        "enable_two_batch_overlap",
    }
    for field, value in values.items():
        if field in bool_fields and not isinstance(value, bool):
            raise ConfigError(f"{flag_of[field]} takes no value (got {value!r})")
        if field not in bool_fields and value is True:
            raise ConfigError(f"{flag_of[field]} needs a value")


def check_values(values: Mapping[str, Any], flag_of: Mapping[str, str]) -> None:
    """Refuse what SGLang's parser refuses (a choice not in its list, a non-integer), before
    anything acts on it: `--kv-cache-dtype fp9_bogus` must not become a namespace that purges
    the good one."""
    for field, value in values.items():
        flag = flag_of.get(field, field)
        if field in CHOICES and value not in CHOICES[field]:
            valid = ", ".join(CHOICES[field])
            raise ConfigError(f"invalid {flag} {value!r}: SGLang {SGLANG_VERSION} accepts {valid}")
        if field in INTEGER and isinstance(value, str):
            try:
                int(value)  # what argparse's type=int does
            except ValueError:
                msg = f"invalid {flag} {value!r}: SGLang {SGLANG_VERSION} takes an integer"
                raise ConfigError(msg) from None
