"""Refuse a vLLM launch's values the way vLLM's parser would, before anything acts on them:
`--kv-cache-dtype fp9_bogus` must not become a namespace that purges the good one.

`flag_of` maps a VllmLaunchArgs field to the flag that sets it, for the message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from cachemgr.canonical import canonical_json
from cachemgr.errors import ConfigError
from cachemgr.vllm.flags import (
    ATTENTION_BACKENDS,
    CHOICES,
    INTEGER,
    KV_SPEC_KINDS,
    VLLM_VERSION,
)
from cachemgr.vllm.tier import CONNECTORS, EXTRA, MULTI, NESTING, TIERS, too_deep

_BOOL_FIELDS = frozenset({"trust_remote_code", "allow_deprecated_quantization"})
KV_ROLES = ("kv_producer", "kv_both", "kv_consumer")
_HUMAN = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT]?)")
_JSON_STRING = re.compile(r'("(?:[^"\\]|\\.)*")')
_JSON_HUMAN = re.compile(r"\b\d+(?:\.\d+)?[kKmMgGtT]\b")
# Lists and objects within one another a config may hold: vLLM's own JSON parser stops near
# 200, and copying a config thousands deep would end in a RecursionError, not a message.
JSON_DEPTH = 100


def check(values: Mapping[str, Any], flag_of: Mapping[str, str]) -> None:
    """A switch given a value, a value flag without one, a choice vLLM does not list, an int
    flag that int() refuses: one ConfigError naming the flag."""
    for field, value in values.items():
        flag = flag_of.get(field, field)
        if field in _BOOL_FIELDS:
            if not isinstance(value, bool):
                raise ConfigError(f"{flag} takes no value (got {value!r})")
            continue
        if value is True:
            raise ConfigError(f"{flag} needs a value")
        if field in CHOICES and value not in CHOICES[field]:
            valid = ", ".join(CHOICES[field])
            raise ConfigError(f"invalid {flag} {value!r}: vLLM {VLLM_VERSION} accepts {valid}")
        if field in INTEGER:
            try:
                int(value)  # argparse's type=int
            except ValueError:
                raise ConfigError(
                    f"invalid {flag} {value!r}: vLLM {VLLM_VERSION} takes an integer"
                ) from None


def max_model_len(raw: str | None) -> int | None:
    """--max-model-len as vLLM's human_readable_int_or_auto reads it (32k = 32000,
    32K = 32768); None for absent, auto and -1 (the model's own length)."""
    if raw is None or raw.strip() == "-1" or raw.strip().lower() == "auto":
        return None
    try:
        return _human_int(raw.strip())
    except ValueError:
        raise ConfigError(
            f"invalid --max-model-len {raw!r}: vLLM takes 4096, 32k, 32K or auto"
        ) from None


def _human_int(text: str) -> int:
    """vLLM's human_readable_int (utils/argparse_utils.py): 25.6k = 25600, 2K = 2048; ValueError
    for what it refuses (a decimal with a binary suffix among them)."""
    m = _HUMAN.fullmatch(text)
    if m is None or (m[2].isupper() and not m[1].isdigit()) or (not m[2] and "." in m[1]):
        raise ValueError(text)
    if not m[2]:
        return int(m[1])
    if m[2].isupper():
        return int(m[1]) << (10 * ("KMGT".index(m[2]) + 1))
    return int(float(m[1]) * {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}[m[2]])


def config_json(raw: str) -> Any:
    """A config flag's JSON value as vLLM reads it: its human-readable numbers outside strings
    (`"cpu_bytes_to_use": 16G`) expanded first (engine/arg_utils.py
    `_expand_json_human_readable_numbers`); ValueError where vLLM refuses the text."""
    parts = _JSON_STRING.split(raw)
    for i in range(0, len(parts), 2):  # (the odd ones are strings)
        parts[i] = _JSON_HUMAN.sub(lambda m: str(_human_int(m[0])), parts[i])
    return json.loads("".join(parts))


def _json_object(flag: str, raw: str, load: Callable[[str], Any] = json.loads) -> dict[str, Any]:
    try:
        data = load(raw)
    except (ValueError, RecursionError):
        data = None
    if not isinstance(data, dict):
        raise ConfigError(f"{flag} is not a JSON object: {raw!r:.80}")
    if _depth(data) > JSON_DEPTH:
        raise ConfigError(f"{flag}: JSON nested more than {JSON_DEPTH} levels deep")
    return data


def _depth(value: Any) -> int:
    """How deep lists and objects nest in a JSON value (without recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            todo += [(v, depth + 1) for v in (node.values() if isinstance(node, dict) else node)]
    return deepest


def hf_overrides(raw: str | None) -> str | None:
    """--hf-overrides as canonical JSON (key order and spaces don't count); None if empty."""
    data = _json_object("--hf-overrides", raw) if raw else {}
    return canonical_json(data, ensure_ascii=True) if data else None


def quantization_config(raw: str | None) -> str | None:
    """--quantization-config (the per-layer-kind specs of an online quantization, read as
    vLLM's parse_dataclass reads it: human-readable numbers expanded) as canonical JSON; None
    if empty. Its schema (QuantizationConfigArgs) is vLLM's to check at start."""
    data = _json_object("--quantization-config", raw, config_json) if raw else {}
    return canonical_json(data, ensure_ascii=True) if data else None


def attention(backend: str | None, raw_config: str | None) -> str | None:
    """What of --attention-backend / --attention-config decides the KV cache layout vLLM's
    attention and the offloading connector settle on (v1/attention/backends/utils.py
    resolve_kv_cache_layout; a hisparse config makes the connector ask for BLHNC), as canonical
    JSON; None when neither names a backend nor hisparse. Backend names as vLLM reads them
    (AttentionConfig.validate_backend_before: upper-cased, `auto` = unset)."""
    config = _json_object("--attention-config", raw_config) if raw_config else {}
    given = config.get("backend")
    if isinstance(given, str) and given.lower() == "auto":
        given = None  # (the config's validator makes it None before vLLM compares the two)
    if backend == "":
        backend = None  # (vLLM's parser reads `--attention-backend ""` as unset: "$ATTN" empty)
    if backend is not None and given is not None:
        raise ConfigError("--attention-backend and --attention-config's backend: vLLM takes one")
    chosen = backend if backend is not None else given
    out: dict[str, Any] = {}
    if isinstance(chosen, str) and chosen.lower() != "auto":
        out["backend"] = _backend(chosen)
    per_kind = config.get("backend_per_kind")
    if isinstance(per_kind, dict) and per_kind:
        out["backend_per_kind"] = {_spec_kind(k): _backend(str(v)) for k, v in per_kind.items()}
    if config.get("hisparse_config") is not None:
        out["hisparse"] = True
    return canonical_json(out, ensure_ascii=True) if out else None


def _backend(name: str) -> str:
    """An attention backend as vLLM reads it (upper-cased), or the ConfigError vLLM's start
    would end in: the launch must not cost the good cache first."""
    if name.upper() not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"invalid attention backend {name!r}: vLLM {VLLM_VERSION} accepts auto or "
            f"{', '.join(sorted(ATTENTION_BACKENDS))} (any case)"
        )
    return name.upper()


def _spec_kind(kind: str) -> str:
    if kind.lower() not in KV_SPEC_KINDS:
        raise ConfigError(
            f"invalid --attention-config backend_per_kind key {kind!r}: vLLM {VLLM_VERSION} "
            f"takes {', '.join(sorted(KV_SPEC_KINDS))}"
        )
    return kind


def kv_transfer_config(raw: str | None) -> dict[str, Any] | None:
    """--kv-transfer-config parsed, its tier list checked as vLLM's TieringOffloadingSpec
    checks it (a list of objects, each with a "type")."""
    if raw is None:
        return None
    config = _json_object("--kv-transfer-config", raw, config_json)
    _connector(config, "--kv-transfer-config", NESTING)
    return config


def _connector(config: dict[str, Any], where: str, nesting: int) -> None:
    """One connector's config checked, and a MultiConnector's children (to `nesting` levels),
    each as vLLM checks the KVTransferConfig it builds of it."""
    # KVTransferConfig's validator (vllm/config/kv_transfer.py)
    if config.get("kv_connector") is not None and config.get("kv_role") not in KV_ROLES:
        roles = ", ".join(KV_ROLES)
        raise ConfigError(
            f"{where}: kv_role {config.get('kv_role')!r} is not one of {roles} "
            "(vLLM needs one with kv_connector)"
        )
    extra = config.get(EXTRA, {})
    if not isinstance(extra, dict):
        raise ConfigError(f"{where}: {EXTRA} is not a JSON object")
    tiers = extra.get(TIERS, [])
    if not isinstance(tiers, list) or not all(isinstance(t, dict) for t in tiers):
        raise ConfigError(f"{where}: {EXTRA}.{TIERS} is not a list of objects")
    if any(not isinstance(t.get("type"), str) for t in tiers):
        raise ConfigError(f'{where}: a {TIERS} entry has no "type"')
    if config.get("kv_connector") == MULTI:
        children = extra.get(CONNECTORS, [])
        if not isinstance(children, list) or not all(isinstance(c, dict) for c in children):
            raise ConfigError(f"{where}: {EXTRA}.{CONNECTORS} is not a list of objects")
        if children and not nesting:
            raise too_deep()
        for i, child in enumerate(children):
            _connector(child, f"{where} connector {i}", nesting - 1)
