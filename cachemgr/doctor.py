"""Lint an SGLang launch for the HiCache L3 file-cache pitfalls operators hit (FIELD_NOTES)."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Literal

from cachemgr.fs import reserve
from cachemgr.fs.usage import DiskUsage, DiskUsageFn
from cachemgr.gc.find import own_temps
from cachemgr.gc.policy import GcPolicy
from cachemgr.layout import NS_ID_RE, Layout
from cachemgr.ns.bindings import read_bindings
from cachemgr.ns.prelaunch import STORAGE_DIR_ENV
from cachemgr.ns.purge import describe_trash
from cachemgr.ns.registry import list_namespaces
from cachemgr.sglang.args import LaunchArgs
from cachemgr.state.store import Store
from cachemgr.units import human_bytes

Severity = Literal["error", "warning", "info"]
MAX_SIZE_ENV = "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"
SGLANG_DEFAULT_DIR = "/tmp/hicache"  # HiCacheFile's file_path default (hicache_storage.py)
# Substrings of architectures / model_type of hybrid Mamba/linear-attention models
# (sglang/srt/configs/hybrid_arch.py and model configs).
_HYBRID_NAMES = (
    "mamba", "nemotronh", "nemotron_h", "falconh1", "falcon_h1", "lfm2", "jamba", "zaya",
    "qwen3next", "qwen3_next", "kimilinear", "kimi_linear", "granitemoehybrid", "inkling",
)  # fmt: skip
_ENV_ASSIGN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


@dataclass(frozen=True)
class Finding:
    """One problem: how bad, a stable code, what is wrong, how to fix it."""

    severity: Severity
    code: str
    message: str
    fix: str


def exit_code(findings: Sequence[Finding]) -> int:
    """0 clean, 1 warnings, 2 errors."""
    severities = {f.severity for f in findings}
    return 2 if "error" in severities else 1 if "warning" in severities else 0


def launch_env(command: Sequence[str]) -> dict[str, str]:
    """`VAR=value` assignments before the program (`env A=1 sglang serve …`)."""
    out: dict[str, str] = {}
    for tok in command:
        if tok == "env":
            continue
        if not _ENV_ASSIGN.fullmatch(tok):
            break
        key, _, value = tok.partition("=")
        out[key] = value
    return out


def parse_size(value: str) -> int | None:
    """SGLang's human_readable_int: 200G, 25.6k, 1Gi, 1048576; None if unset or invalid."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?", value.strip())
    if m is None:
        return None
    number, suffix = m.groups()
    iec = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    si = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, None: 1}
    try:
        size = int(number) * iec[suffix] if suffix in iec else int(Decimal(number) * si[suffix])
    except (InvalidOperation, ValueError):
        return None
    return size or None


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem of `path` or of its nearest existing ancestor."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def is_hybrid(config: Mapping[str, Any]) -> bool:
    """Whether a config.json describes a hybrid Mamba / linear-attention model."""
    configs = [config]
    if isinstance(config.get("text_config"), dict):
        configs.append(config["text_config"])
    for cfg in configs:
        names = [str(cfg.get("model_type", "")), *map(str, cfg.get("architectures") or [])]
        if any(h in n.lower() for n in names for h in _HYBRID_NAMES):
            return True
        layer_types = [str(t) for t in cfg.get("layer_types") or []]
        if any(t in ("linear_attention", "mamba", "mamba2") for t in layer_types):
            return True
        if any(k.startswith(("mamba_", "mamba2_", "ssm_")) for k in cfg):
            return True
    return False


def lint(
    args: LaunchArgs,
    *,
    layout: Layout,
    env: Mapping[str, str],
    model_config: Mapping[str, Any] | None,
    cap_bytes: int | None = None,
    disk_free: Callable[[Path], int] = free_bytes,
) -> list[Finding]:
    """Every finding for a launch; `model_config` is config.json if the model dir is local."""
    found: list[Finding] = []
    file_backend = args.enable_hierarchical_cache and args.hicache_storage_backend == "file"
    if not args.enable_hierarchical_cache:
        found.append(
            Finding(
                "warning",
                "no-hicache",
                "--enable-hierarchical-cache is missing: no L3 cache, nothing for cachemgr to do",
                "add --enable-hierarchical-cache --hicache-storage-backend file --page-size 64",
            )
        )
    elif args.hicache_storage_backend != "file":
        backend = args.hicache_storage_backend or "none"
        found.append(
            Finding(
                "warning",
                "not-file-backend",
                f"--hicache-storage-backend is {backend}: cachemgr manages only the file backend",
                "use --hicache-storage-backend file, or do not run cachemgr for this server",
            )
        )
    if file_backend:
        found += _page_size(args)
    found += _mamba(args, model_config)
    if file_backend:
        found += _storage(args, layout, env, cap_bytes, disk_free)
    return found


def _page_size(args: LaunchArgs) -> list[Finding]:
    """Page size 1 is an error; unknown until the GPU is seen (no flag) is a warning."""
    page = args.resolved_page_size
    if page == 1:
        return [
            Finding(
                "error",
                "page-size-1",
                "--page-size 1 makes the file backend write one file per token: "
                "in the field 15.4 GB in 400,000 files and 0 hits, once 440 GB",
                "--page-size 64 (field: 82% hit rate across restarts, TTFT 24.5 s → 5.8 s, 2.7 GB)",
            )
        ]
    if page is None:
        # Without the flag SGLang picks it from the GPU and attention backend: 1 on most
        # CUDA/ROCm GPUs (one file per token), more on some; doctor cannot tell which.
        return [
            Finding(
                "warning",
                "page-size-unpinned",
                "no --page-size: SGLang decides it on the GPU (1 on most CUDA/ROCm GPUs, which "
                "makes the file backend write one file per token)",
                "pin it: --page-size 64",
            )
        ]
    return []


def _mamba(args: LaunchArgs, config: Mapping[str, Any] | None) -> list[Finding]:
    if config is None:
        return [
            Finding(
                "info",
                "model-not-local",
                f"{args.model_path} is not a local model dir: the hybrid-model check was skipped",
                "run doctor where the model is on disk (or in the HF cache)",
            )
        ]
    page = args.resolved_page_size
    # page None: SGLang picks it on the GPU, so divisibility cannot be known here.
    if page is None or not is_hybrid(config) or args.mamba_track_interval % page == 0:
        return []
    return [
        Finding(
            "error",
            "mamba-track-interval",
            f"hybrid model: --mamba-track-interval {args.mamba_track_interval} is not divisible by "
            f"page size {page}; SGLang refuses to start",
            f"use a page size that divides {args.mamba_track_interval} (e.g. 64), or set "
            f"--mamba-track-interval to a multiple of {page}",
        )
    ]


def _storage(
    args: LaunchArgs,
    layout: Layout,
    env: Mapping[str, str],
    cap: int | None,
    disk_free: Callable[[Path], int],
) -> list[Finding]:
    found: list[Finding] = []
    extra = _extra_config(args)
    # HiCacheFile: the env var first, then extra-config file_storage_path, then its default.
    storage = env.get(STORAGE_DIR_ENV) or extra.get("file_storage_path") or SGLANG_DEFAULT_DIR
    path = Path(os.path.abspath(str(storage)))
    managed = path.parent == layout.ns_root and NS_ID_RE.fullmatch(path.name) is not None
    if not managed:
        found.append(
            Finding(
                "warning",
                "unmanaged-dir",
                f"storage dir {path} is not a cachemgr namespace under {layout.root}: pages "
                "written under another model, KV dtype or page size would be served as hits",
                "start the server with `cachemgr exec -- <launch cmd>` or with the env from "
                "`cachemgr init --env-file`",
            )
        )
    sg_cap = parse_size(str(extra.get("max_size") or env.get(MAX_SIZE_ENV) or ""))
    if sg_cap is not None:
        both = (
            f"; cachemgr's GC caps the root too (gc_max_bytes {human_bytes(cap)}): two owners "
            "evicting the same files"
            if cap is not None
            else ""
        )
        found.append(
            Finding(
                "warning",
                "sglang-evictor",
                f"SGLang's own file evictor is on (max_size {human_bytes(sg_cap)} per TP rank, so "
                f"up to {human_bytes(sg_cap * args.tp_size)} at tp {args.tp_size}); it keeps "
                f"recency only in memory, never reaps other models' files or .tmp leftovers{both}",
                f"pick one owner: unset {MAX_SIZE_ENV} / max_size and cap the root with cachemgr's "
                "gc_max_bytes (recommended), or keep SGLang's and leave gc_max_bytes unset",
            )
        )
    limit = cap if cap is not None else (sg_cap * args.tp_size if sg_cap else None)
    if limit is not None:
        free = disk_free(path)
        if free < limit:
            found.append(
                Finding(
                    "warning",
                    "disk-smaller-than-cap",
                    f"{path}'s filesystem has {human_bytes(free)} free, less than the cap of "
                    f"{human_bytes(limit)}: the disk fills before eviction starts",
                    "lower the cap below the free space, or move the root to a bigger disk",
                )
            )
    return found


def _extra_config(args: LaunchArgs) -> dict[str, Any]:
    raw = args.hicache_storage_backend_extra_config
    try:
        data = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


def lint_root(layout: Layout, store: Store) -> list[Finding]:
    """Damage under the root: namespaces in a bad state, trash an earlier run left, binding
    files that cannot be read."""
    found = []
    hands_off = "inspect it by hand; cachemgr will not touch it"
    for ns in list_namespaces(layout, store):
        if ns.state in ("unsafe", "bad-manifest"):
            found.append(
                Finding("error", f"ns-{ns.state}", f"ns {ns.ns_id}: {ns.problem}", hands_off)
            )
        elif ns.state == "no-manifest":
            what = f"{layout.ns_dir(ns.ns_id)} has no manifest: nobody knows who wrote its pages"
            fix = f"cachemgr purge --namespace {ns.ns_id}"
            found.append(Finding("warning", "ns-no-manifest", what, fix))
    for entry in describe_trash(layout):
        if entry.problem:
            what = f".trash/{entry.name}: {entry.problem}"
            found.append(Finding("error", "trash-unsafe", what, hands_off))
        else:
            what = f".trash/{entry.name} still holds {entry.pages:,} pages of an unfinished purge"
            fix = "cachemgr purge --unbound --yes (or let the daemon finish it)"
            found.append(Finding("warning", "trash-left", what, fix))
    for problem in read_bindings(layout)[1]:  # those the DB knows were rewritten on open
        fix = "run init for that instance again (it rewrites the file), or move it away"
        found.append(Finding("warning", "binding-unreadable", problem, fix))
    return found + _own_temps(layout) + _corrupt_db_copies(layout)


def _own_temps(layout: Layout) -> list[Finding]:
    """Temp files of cachemgr's own atomic writes that a kill -9 left (GC removes them)."""
    what = "{} is a temp file a killed cachemgr write left ({} bytes)"
    fix = "`cachemgr gc` removes it once older than gc_tmp_ttl, or remove it by hand"
    paths = [(layout.root / t.rel_dir / t.name, t.size) for t in own_temps(layout)]
    return [Finding("warning", "own-temp-left", what.format(*p), fix) for p in paths]


DiskState = Literal["ok", "low", "full"]


def disk_state(disk: DiskUsage, policy: GcPolicy) -> tuple[DiskState, int]:
    """Full: less free than GC's floor (or than the state DB needs to open); low: under 1.5
    times that. With the limit in bytes."""
    limit = max(policy.floor(disk), reserve.reserve_size(disk.total))
    state: DiskState = "full" if disk.free < limit else "low" if disk.free < limit * 1.5 else "ok"
    return state, limit


def lint_disk(
    layout: Layout, policy: GcPolicy, usage: DiskUsageFn = shutil.disk_usage
) -> list[Finding]:
    """A full root filesystem is an error, a nearly full one a warning (see disk_state)."""
    disk = DiskUsage(*usage(layout.root))
    state, limit = disk_state(disk, policy)
    what = f"{filesystem_line(disk)}; GC keeps {human_bytes(limit)} free"
    fix = "cachemgr gc --yes frees it down to the floor (the daemon does by itself); or add space"
    if state == "full":
        return [Finding("error", "disk-full", f"the root's filesystem is full: {what}", fix)]
    if state == "low":
        return [Finding("warning", "disk-low", f"the root's filesystem is low: {what}", fix)]
    return []


def filesystem_line(disk: DiskUsage) -> str:
    """`3.6 MB free of 57.4 MB (6.3%)`: how full a filesystem is, for people."""
    pct = 100 * disk.free / disk.total if disk.total else 0.0
    return f"{human_bytes(disk.free)} free of {human_bytes(disk.total)} ({pct:.1f}%)"


def _corrupt_db_copies(layout: Layout) -> list[Finding]:
    """State DBs found corrupt and moved aside (store.py) take disk space until someone looks."""
    db = layout.db_path
    aside = db.parent.glob(f"{db.name}.corrupt-*")  # and their -wal/-shm, not listed twice
    copies = sorted(p for p in aside if p.name.rpartition("-")[2].isdigit())
    what = "{} is a state DB found corrupt and moved aside; the index was rebuilt from disk"
    fix = "keep it for a bug report, or remove {} (and its -wal/-shm)"
    return [Finding("warning", "state-db-corrupt", what.format(p), fix.format(p)) for p in copies]
