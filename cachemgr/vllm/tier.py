"""The fs secondary tier in a vLLM launch's `--kv-transfer-config`.

vLLM's TieringOffloadingSpec (0.33.0, 0.34.0) (vllm/v1/kv_offload/tiering/spec.py) reads
`kv_connector_extra_config.secondary_tiers`, a list of tier objects; the one with
`"type": "fs"` writes its blocks below `root_dir` (tiering/fs/manager.py). Under a
MultiConnector (an offloading connector beside a transfer one, such as NIXL's) that config is
one of its children: `kv_connector_extra_config.connectors` lists them, each a
kv-transfer-config of its own (distributed/kv_transfer/kv_connector/v1/multi_connector.py).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict

from cachemgr.errors import ConfigError

EXTRA = "kv_connector_extra_config"
TIERS = "secondary_tiers"
CONNECTORS = "connectors"  # a MultiConnector's children
MULTI = "MultiConnector"
# MultiConnectors within MultiConnectors cachemgr follows (vLLM sets no limit; a deeper one is
# refused, not followed until the stack runs out).
NESTING = 8


class FsTier(BaseModel):
    """The fs tier a launch configures: where its blocks go."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    root_dir: str


def connector_configs(config: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The connectors a kv-transfer-config runs: itself, or a MultiConnector's children (and
    theirs), as vLLM builds each child from its entry."""
    if config.get("kv_connector") != MULTI:
        yield config
        return
    extra = config.get(EXTRA)
    children = extra.get(CONNECTORS) if isinstance(extra, dict) else None
    for child in children if isinstance(children, list) else []:
        if isinstance(child, dict):
            yield from connector_configs(child)


def fs_tier_objects(config: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The `"type": "fs"` objects of a kv-transfer-config (already checked by argcheck)."""
    found = []
    for connector in connector_configs(config or {}):
        tiers = (connector.get(EXTRA) or {}).get(TIERS) or []
        found += [t for t in tiers if isinstance(t, dict) and t.get("type") == "fs"]
    return found


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
    hit = False
    for tier in _fs_tiers_in(out):
        tier["root_dir"] = root_dir
        hit = True
    return out, hit


def _fs_tiers_in(value: Any, depth: int = 0) -> Iterator[dict[str, Any]]:
    """The fs tier objects in a config or a part of one: a connector's config, its extra
    config, a list of tiers or of a MultiConnector's children, one tier."""
    if depth > 3 * NESTING + 3:  # (a connector, its extra config, its list of children)
        raise ConfigError(f"--kv-transfer-config: connectors nested more than {NESTING} deep")
    deeper = depth + 1
    if isinstance(value, list):
        for item in value:
            yield from _fs_tiers_in(item, deeper)
    elif isinstance(value, dict) and value.get("type") == "fs":
        yield value
    elif isinstance(value, dict) and EXTRA in value:  # a connector's whole config
        if value.get("kv_connector") == MULTI or value.get("kv_connector") is None:
            yield from _fs_tiers_in(value[EXTRA], deeper)
        elif isinstance(value[EXTRA], dict):
            yield from _fs_tiers_in(value[EXTRA].get(TIERS), deeper)
    elif isinstance(value, dict):  # an extra config (a dotted key's part: whose, unknown)
        yield from _fs_tiers_in(value.get(TIERS), deeper)
        yield from _fs_tiers_in(value.get(CONNECTORS), deeper)
