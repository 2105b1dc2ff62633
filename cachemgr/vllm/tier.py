"""The fs secondary tier in a vLLM launch's `--kv-transfer-config`.

vLLM's TieringOffloadingSpec (0.33.0, 0.34.0) (vllm/v1/kv_offload/tiering/spec.py) reads
`kv_connector_extra_config.secondary_tiers`, a list of tier objects; the one with
`"type": "fs"` writes its blocks below `root_dir` (tiering/fs/manager.py).
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel, ConfigDict

from cachemgr.errors import ConfigError

EXTRA = "kv_connector_extra_config"
TIERS = "secondary_tiers"


class FsTier(BaseModel):
    """The fs tier a launch configures: where its blocks go."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    root_dir: str


def fs_tier_objects(config: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The `"type": "fs"` objects of a kv-transfer-config (already checked by argcheck)."""
    tiers = ((config or {}).get(EXTRA) or {}).get(TIERS) or []
    return [t for t in tiers if isinstance(t, dict) and t.get("type") == "fs"]


def fs_tier(config: dict[str, Any] | None) -> FsTier | None:
    """The launch's fs tier, None without one; ConfigError for one cachemgr cannot manage."""
    found = fs_tier_objects(config)
    if not found:
        return None
    if len(found) > 1:
        raise ConfigError(
            f"--kv-transfer-config has {len(found)} fs tiers: cachemgr manages one per server"
        )
    root = found[0].get("root_dir")
    if not isinstance(root, str) or not root:
        raise ConfigError('--kv-transfer-config: the fs tier has no "root_dir" string')
    return FsTier(root_dir=root)


def with_root_dir(value: Any, root_dir: str) -> tuple[Any, bool]:
    """`value` (a config, or a part of one built by dotted keys) with every fs tier's
    root_dir set to `root_dir`, and whether it held one."""
    out = copy.deepcopy(value)
    tiers: list[Any] = []
    if isinstance(out, dict) and isinstance(out.get(EXTRA), dict):
        tiers = out[EXTRA].get(TIERS) or []
    elif isinstance(out, dict) and TIERS in out:
        tiers = out[TIERS] or []
    elif isinstance(out, list):
        tiers = out
    elif isinstance(out, dict) and out.get("type") == "fs":
        tiers = [out]
    hit = False
    for tier in tiers if isinstance(tiers, list) else []:
        if isinstance(tier, dict) and tier.get("type") == "fs":
            tier["root_dir"] = root_dir
            hit = True
    return out, hit
