"""Doctor's lint of an SGLang launch: the HiCache L3 file-cache pitfalls operators hit
(FIELD_NOTES)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from cachemgr.doctor.finding import Finding
from cachemgr.doctor.storage import (
    Launch,
    exec_line,
    exec_namespace,
    launched,
    lint_storage_identity,
    managed_ns,
    under_exec,
)
from cachemgr.errors import CachemgrError
from cachemgr.identity.record import Digested
from cachemgr.layout import Layout
from cachemgr.sglang.args import LaunchArgs
from cachemgr.sglang.hicache import PAGE_ERE, STORAGE_DIR_ENV
from cachemgr.sglang.identity import locate_target, target_config
from cachemgr.units import human_bytes

MAX_SIZE_ENV = "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"
DEFAULT_DIR = "/tmp/hicache"  # HiCacheFile's file_path default (hicache_storage.py)
# Substrings of architectures / model_type of hybrid Mamba/linear-attention models
# (sglang/srt/configs/hybrid_arch.py and model configs).
_HYBRID_NAMES = (
    "mamba",
    "nemotronh",
    "nemotron_h",
    "falconh1",
    "falcon_h1",
    "lfm2",
    "jamba",
    "zaya",
    "qwen3next",
    "qwen3_next",
    "kimilinear",
    "kimi_linear",
    "granitemoehybrid",
    "inkling",
)


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


def storage_dir(args: LaunchArgs, env: Mapping[str, str]) -> Path:
    """The dir HiCacheFile will use: the env var first, then extra-config file_storage_path,
    then its default."""
    storage = env.get(STORAGE_DIR_ENV) or args.extra_config.get("file_storage_path")
    return Path(os.path.abspath(str(storage or DEFAULT_DIR)))


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


def _radix_cache_replaced(args: LaunchArgs) -> str | None:
    """The flag with which SGLang builds a cache other than the radix cache its hierarchical
    cache extends (mem_cache/registry.py), or turns hierarchical cache off (dllm_hook.py)."""
    if args.enable_lmcache:
        return "--enable-lmcache replaces the radix cache with LMCache's"
    if args.enable_flexkv or args.radix_cache_backend == "flexkv":
        return "FlexKV (--enable-flexkv, --radix-cache-backend flexkv) replaces the radix cache"
    # (another --radix-cache-backend is registered out of tree: whether it builds SGLang's
    # hierarchical cache, only its code says)
    if args.dllm_algorithm:
        return f"--dllm-algorithm {args.dllm_algorithm} turns hierarchical cache off"
    return None


def no_file_backend(args: LaunchArgs) -> Finding | None:
    """Why the launch would write no page to its storage dir (no L3 file backend), if so:
    init and exec say it too, since the namespace they make would stay empty."""
    decode_offload = (
        args.disaggregation_mode == "decode" and args.disaggregation_decode_enable_offload_kvcache
    )
    if not args.enable_hierarchical_cache and not decode_offload:
        return Finding(
            "warning",
            "no-hicache",
            "--enable-hierarchical-cache is missing: no L3 cache, nothing for cachemgr to do",
            "add --enable-hierarchical-cache --hicache-storage-backend file --page-size 64",
        )
    replaced = _radix_cache_replaced(args)
    if replaced is not None:
        return Finding(
            "warning",
            "radix-cache-replaced",
            f"{replaced}: SGLang builds no hierarchical cache, nothing for cachemgr to do",
            "drop it to use SGLang's file backend, or do not run cachemgr for this server",
        )
    if args.hicache_storage_backend != "file":
        backend = args.hicache_storage_backend or "none"
        return Finding(
            "warning",
            "not-file-backend",
            f"--hicache-storage-backend is {backend}: cachemgr manages only the file backend",
            "use --hicache-storage-backend file, or do not run cachemgr for this server",
        )
    return None


def lint(
    args: LaunchArgs,
    *,
    layout: Layout,
    env: Mapping[str, str],
    model_config: Mapping[str, Any] | None,
    cap_bytes: int | None = None,
    disk_free: Callable[[Path], int] = free_bytes,
    identity: Callable[[], Digested | None] = lambda: None,
    command: Sequence[str] = (),
) -> list[Finding]:
    """Every finding for a launch; `model_config` is config.json if the model dir is local,
    `identity` computes the launch's identity (None if it cannot), `command` is the launch."""
    found: list[Finding] = []
    unused = no_file_backend(args)
    if unused is not None:
        found.append(unused)
    else:
        found += _page_size(args)
    found += _mamba(args, model_config)
    if unused is None:
        given = storage_dir(args, env)
        ns_id = None if managed_ns(given, layout) else exec_namespace(layout, identity)
        path = given if ns_id is None else layout.ns_dir(ns_id)
        exec_cmd = exec_line(layout, command, STORAGE_DIR_ENV, env)
        if ns_id is not None:
            found.append(under_exec(layout, ns_id, given, exec_cmd))
        found += _storage(args, layout, path, env, cap_bytes, disk_free)
        bare = tuple(launched(command, STORAGE_DIR_ENV))
        launch = Launch(bare, exec_cmd, STORAGE_DIR_ENV, PAGE_ERE)
        found += lint_storage_identity(path, layout, identity, launch)
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
                f"{args.model_path}: no config.json of it here (not on disk, or a GGUF file "
                "whose config is in its own metadata): the hybrid-model check was skipped",
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
    path: Path,
    env: Mapping[str, str],
    cap: int | None,
    disk_free: Callable[[Path], int],
) -> list[Finding]:
    found: list[Finding] = []
    extra = args.extra_config
    if managed_ns(path, layout) is None:
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


def model_config(args: LaunchArgs, env: Mapping[str, str]) -> dict[str, Any] | None:
    """The config.json SGLang reads for the model if it is on disk here (a dir, the HF cache,
    or beside a GGUF file, as `locate_target` finds them), else None."""
    try:
        return target_config(locate_target(args, env))[0]
    except CachemgrError:
        return None
