"""Helpers for the tests of vLLM launches: a real model dir, a launch command with an fs tier,
`cachemgr init` on it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tests.nsfixtures import cli


def tier_config(root_dir: str = "/srv/kv") -> dict[str, Any]:
    """A --kv-transfer-config with vLLM's fs tier, as its docs write one."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 1 << 30,
            "secondary_tiers": [{"type": "fs", "root_dir": root_dir}],
        },
    }


def multi_config(root_dir: str = "/srv/kv") -> dict[str, Any]:
    """A MultiConnector's --kv-transfer-config: NIXL's transfer connector beside the
    offloading one, whose fs tier is the second child's."""
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [nixl, tier_config(root_dir)]},
    }


def launch(model: str | Path, *flags: str, config: dict[str, Any] | None = None) -> list[str]:
    """`vllm serve MODEL FLAGS… --kv-transfer-config '{…}'`."""
    cfg = json.dumps(config or tier_config())
    return ["vllm", "serve", str(model), *flags, "--kv-transfer-config", cfg]


def vinit(
    root: Path, command: list[str], *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`cachemgr --root ROOT init EXTRA… -- COMMAND`."""
    return cli("--root", str(root), "init", *extra, "--", *command, env=env)


def vinit_json(
    root: Path, command: list[str], *extra: str, env: dict[str, str] | None = None
) -> dict[str, Any]:
    out = vinit(root, command, "--json", *extra, env=env)
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def root_dir_of(command: list[str]) -> str:
    """The fs tier's root_dir in a rewritten command's plain --kv-transfer-config."""
    at = command.index("--kv-transfer-config")
    tiers = json.loads(command[at + 1])["kv_connector_extra_config"]["secondary_tiers"]
    (root_dir,) = [t["root_dir"] for t in tiers if t["type"] == "fs"]
    return str(root_dir)
