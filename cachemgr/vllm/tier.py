"""The fs secondary tier in a vLLM launch's `--kv-transfer-config`.

vLLM's TieringOffloadingSpec (0.33.0, 0.34.0) (vllm/v1/kv_offload/tiering/spec.py) reads
`kv_connector_extra_config.secondary_tiers`, a list of tier objects; the one with
`"type": "fs"` writes its blocks below `root_dir` (tiering/fs/manager.py). Under a
MultiConnector (an offloading connector beside a transfer one, such as NIXL's) that config is
one of its children: `kv_connector_extra_config.connectors` lists them, each a
kv-transfer-config of its own (distributed/kv_transfer/kv_connector/v1/multi_connector.py).

vLLM runs a tier list only in an OffloadingConnector whose `spec_name` is
TieringOffloadingSpec (absent, it is CPUOffloadingSpec, which ignores the list:
v1/kv_offload/factory.py), and `--kv-offloading-size` replaces the launch's connector
(config/vllm.py `_post_init_kv_transfer_config`). A tier written where vLLM would not run it is
refused with the reason: cachemgr would report a namespace nothing writes to.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from cachemgr.errors import ConfigError

EXTRA = "kv_connector_extra_config"
TIERS = "secondary_tiers"
CONNECTORS = "connectors"  # a MultiConnector's children
MULTI = "MultiConnector"
OFFLOADING = "OffloadingConnector"
TIERING = "TieringOffloadingSpec"
DEFAULT_SPEC = "CPUOffloadingSpec"  # vLLM's when spec_name is absent
FS_TYPES = ("fs", "FileSystemTierManager")  # its registered name, its class (with module_path)
# MultiConnectors within MultiConnectors cachemgr follows (vLLM sets no limit; a deeper one is
# refused, not followed until the stack runs out).
NESTING = 8


class FsTier(BaseModel):
    """The fs tier a launch configures: where its blocks go."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    root_dir: str


@dataclass(frozen=True)
class Offloading:
    """`--kv-offloading-size`, `--kv-offloading-backend` and VLLM_USE_SIMPLE_KV_OFFLOAD: with a
    size, vLLM replaces the launch's connector by its own."""

    size: str | None = None
    backend: str = "native"
    simple: bool = False

    def connector(self) -> str | None:
        """The connector vLLM runs in place of the launch's, None if it keeps it."""
        if self.size is None:
            return None
        if self.backend == "lmcache":
            return "LMCacheMPConnector"
        return "SimpleCPUOffloadConnector" if self.simple else OFFLOADING


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


def _is_fs(tier: Any) -> bool:
    return isinstance(tier, dict) and tier.get("type") in FS_TYPES


def _tiers(connector: dict[str, Any]) -> list[dict[str, Any]]:
    return _extra_tiers(connector.get(EXTRA))


def _extra_tiers(extra: Any) -> list[dict[str, Any]]:
    """The fs tiers of an extra config's tier list."""
    tiers = extra.get(TIERS) if isinstance(extra, dict) else None
    return [t for t in tiers if _is_fs(t)] if isinstance(tiers, list) else []


def too_deep() -> ConfigError:
    """The refusal of connectors nested past NESTING (argcheck's and the rewrite's)."""
    return ConfigError(f"--kv-transfer-config: connectors nested more than {NESTING} deep")


def _idle(connector: dict[str, Any]) -> str | None:
    """Why vLLM would not run this connector's tier list; None if it would. vLLM imports the
    class `kv_connector` names from `kv_connector_module_path` when there is one: an
    OffloadingConnector so found still takes its spec from spec_name; another class, out of
    tree, is taken at its word (as is an out-of-tree spec from spec_module_path)."""
    name = connector.get("kv_connector")
    if name is None:
        return "no kv_connector: vLLM runs none"
    if name != OFFLOADING:
        if connector.get("kv_connector_module_path"):
            return None
        return f"a {name} runs no secondary_tiers (an {OFFLOADING} with spec_name {TIERING} does)"
    extra = connector.get(EXTRA) or {}
    spec = extra.get("spec_name", DEFAULT_SPEC)
    if spec == TIERING or (spec != DEFAULT_SPEC and extra.get("spec_module_path")):
        return None
    said = f"spec_name is {spec!r}" if "spec_name" in extra else f"no spec_name ({spec})"
    return f"{said}: vLLM runs secondary_tiers only with spec_name {TIERING}"


def fs_tier_objects(config: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The fs tier objects vLLM would run of a kv-transfer-config (checked by argcheck)."""
    connectors = connector_configs(config or {})
    return [t for c in connectors if _idle(c) is None for t in _tiers(c)]


def fs_tier(config: dict[str, Any] | None, offloading: Offloading | None = None) -> FsTier | None:
    """The launch's fs tier, None without one; ConfigError for one cachemgr cannot manage or
    vLLM would not run."""
    given = config or {}
    runs = _as_run(given, offloading or Offloading())
    found = fs_tier_objects(runs)
    if not found:
        idle = [c for c in connector_configs(given) if _tiers(c)]
        if idle:
            why = _idle(idle[0])
            if runs.get("kv_connector") != given.get("kv_connector"):
                why = f"--kv-offloading-size makes vLLM run its {runs['kv_connector']} instead"
            raise ConfigError(f"--kv-transfer-config: vLLM would not run its fs tier: {why}")
        return None
    if len(found) > 1:
        raise ConfigError(
            f"--kv-transfer-config has {len(found)} fs tiers: cachemgr manages one per server"
        )
    root = found[0].get("root_dir")
    if not isinstance(root, str) or not root:
        raise ConfigError('--kv-transfer-config: the fs tier has no "root_dir" string')
    return FsTier(root_dir=root)


def _as_run(config: dict[str, Any], offloading: Offloading) -> dict[str, Any]:
    """The config as vLLM runs it: with --kv-offloading-size, its own connector in place of the
    config's, on the config's extra settings (VllmConfig._post_init_kv_transfer_config)."""
    replaced = offloading.connector()
    if replaced is None or not config:
        return config
    return {**config, "kv_connector": replaced, "kv_role": "kv_both"}


def with_root_dir(value: Any, root_dir: str) -> tuple[Any, bool]:
    """`value` (a config, or a part of one built by dotted keys) with every fs tier's
    root_dir set to `root_dir`, and whether it held one."""
    out = copy.deepcopy(value)
    hit = False
    for tier in _fs_tiers_in(out):
        tier["root_dir"] = root_dir
        hit = True
    return out, hit


def _fs_tiers_in(value: Any, nesting: int = 0) -> Iterator[dict[str, Any]]:
    """The fs tier objects in a config or a part of one: a connector's config, its extra
    config, a list of tiers or of a MultiConnector's children, one tier. Only a
    MultiConnector's children are followed down, NESTING levels at most."""
    if nesting > NESTING:
        raise too_deep()
    for item in value if isinstance(value, list) else [value]:
        if not isinstance(item, dict):
            continue
        if _is_fs(item):
            yield item
        elif EXTRA in item:  # a connector's config
            yield from _tiers(item)
            if item.get("kv_connector") in (MULTI, None) and isinstance(item[EXTRA], dict):
                yield from _fs_tiers_in(item[EXTRA].get(CONNECTORS), nesting + 1)
        elif not isinstance(value, list):  # an extra config (a dotted key's part: whose, unknown)
            yield from _extra_tiers(item)
            yield from _fs_tiers_in(item.get(CONNECTORS), nesting + 1)


def root_dirs_in_argv(argv: Sequence[str]) -> list[str]:
    """The root_dir of every fs tier in a command's arguments, as written: in each JSON value
    among them (`--kv-transfer-config '{…}'` or `=…`, a dotted key's `'[{"type": "fs", …}]'`).
    Any fs tier counts, one vLLM would not run too: it answers who may still write a dir."""
    found = []
    for arg in argv:
        text = arg.partition("=")[2] if arg.startswith("--") else arg
        if not text.lstrip().startswith(("{", "[")):
            continue
        try:
            tiers = list(_fs_tiers_in(json.loads(text)))
        except (ValueError, RecursionError, ConfigError):
            continue  # not JSON, or nested past what vLLM's config would be
        found += [t["root_dir"] for t in tiers if isinstance(t.get("root_dir"), str)]
    return found
