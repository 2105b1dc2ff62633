"""Doctor's lint of a vLLM launch for the fs-tier pitfalls: no cap anywhere, a root_dir
cachemgr does not manage, one that other models' servers write to, one that holds another
identity's blocks."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from cachemgr.doctor.finding import Finding
from cachemgr.doctor.storage import (
    changes_since,
    exec_line,
    exec_namespace,
    identity_mismatch,
    managed_ns,
    under_exec,
)
from cachemgr.errors import CachemgrError
from cachemgr.fs.safe import open_dir, read_regular
from cachemgr.identity.record import Digested
from cachemgr.layout import Layout
from cachemgr.ns.manifest import read_manifest
from cachemgr.vllm.args import VllmLaunchArgs

# vLLM's folder for one model and configuration: <model, "/" → "_">_<digest12> (file_mapper.py)
_FOLDER = re.compile(r".+_[0-9a-f]{12}")
_CONFIG_MAX = 1 << 20
_FOLDERS_READ = 1000  # a root_dir with more folders than this is read only that far


def lint(
    args: VllmLaunchArgs,
    *,
    layout: Layout,
    cap_bytes: int | None,
    identity: Callable[[], Digested | None],
    command: Sequence[str],
) -> list[Finding]:
    """Every finding for a vLLM launch; `identity` computes its identity (None if it cannot)."""
    if args.tier is None:
        return [
            Finding(
                "warning",
                "no-fs-tier",
                "the launch has no fs tier in --kv-transfer-config: nothing for cachemgr to do",
                'add kv_connector_extra_config.secondary_tiers [{"type": "fs", "root_dir": …}] '
                "(docs/vllm.md)",
            )
        ]
    given = Path(os.path.abspath(args.tier.root_dir))
    exec_cmd = exec_line(layout, command, None, {})
    found: list[Finding] = []
    # exec rewrites root_dir to the launch's namespace (vllm/rewrite.py)
    exec_ns = None if managed_ns(given, layout) else exec_namespace(layout, identity)
    path = given if exec_ns is None else layout.ns_dir(exec_ns)
    if exec_ns is not None:
        found.append(under_exec(layout, exec_ns, given, exec_cmd))
    if cap_bytes is None:
        found.append(
            Finding(
                "warning",
                "fs-tier-uncapped",
                "vLLM's fs tier never deletes a block (0.33.0 and 0.34.0 have no size limit) and "
                "cachemgr has neither gc_max_bytes nor gc_namespace_max_bytes: the disk fills "
                "until writes fail",
                "set gc_max_bytes (cachemgr.toml or CACHEMGR_GC_MAX_BYTES) and run "
                "`cachemgr serve` beside the server",
            )
        )
    ns_id = managed_ns(path, layout)
    if ns_id is None:
        found.append(
            Finding(
                "warning",
                "unmanaged-root-dir",
                f"fs tier root_dir {path} is not a cachemgr namespace under {layout.root}: "
                "blocks written under other weights, a revision, RoPE overrides or another "
                "vLLM would be served as hits (vLLM's folder name leaves them out)",
                f"start the server with `{exec_cmd}`",
            )
        )
    others = sorted({m for m in folder_models(path) if m != args.model})
    if others:
        found.append(
            Finding(
                "warning",
                "root-dir-shared",
                f"fs tier root_dir {path} also holds blocks of {', '.join(others[:3])}: servers "
                "of several models share it, so no one model's cache can be capped, purged "
                "or changed on its own",
                f"give each server its own namespace: `{exec_cmd}`",
            )
        )
    if ns_id is not None:
        found += _identity_mismatch(layout, ns_id, identity, exec_cmd)
    return found


def folder_models(root_dir: Path) -> list[str]:
    """`model_name` of every vLLM folder's config.json in `root_dir` (not through symlinks)."""
    models: list[str] = []
    try:
        entries = [e for e in os.scandir(root_dir) if _FOLDER.fullmatch(e.name)]
    except OSError:
        return []
    for entry in entries[:_FOLDERS_READ]:
        if not entry.is_dir(follow_symlinks=False):
            continue
        try:
            with open_dir(root_dir, entry.name) as fd:
                fields = json.loads(read_regular(fd, "config.json", _CONFIG_MAX))
        except (OSError, ValueError, RecursionError, CachemgrError):
            continue  # no config.json, a partial one (vLLM writes it in place), a symlink
        if isinstance(fields, dict) and isinstance(fields.get("model_name"), str):
            models.append(fields["model_name"])
    return models


def _identity_mismatch(
    layout: Layout, ns_id: str, identity: Callable[[], Digested | None], exec_cmd: str
) -> list[Finding]:
    try:
        manifest = read_manifest(layout, ns_id)
    except CachemgrError:
        return []  # a damaged manifest: lint_root reports it with the namespace
    mine = identity() if manifest is not None else None
    changes = changes_since(manifest, mine) if manifest is not None and mine is not None else []
    if not changes:
        return []
    return [
        identity_mismatch(
            f"fs tier root_dir {layout.ns_dir(ns_id)}",
            changes[:3],
            ": the server would load its blocks as hits",
            f"start the server with `{exec_cmd}` (its own namespace)",
        )
    ]
