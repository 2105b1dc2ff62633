"""Hand-made vLLM fs-tier trees (the layout vLLM 0.33.0 and 0.34.0 write, docs/vllm-notes.md), for
tests that need many blocks or damage vLLM itself would not make."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from cachemgr.layout import Layout
from cachemgr.ns.registry import ensure_namespace
from cachemgr.state.store import Store

MODEL = "Qwen/Qwen3-0.6B"
SIZE = 4096  # bytes of a hand-made block


def write_folder(ns_dir: Path, *, model: str = MODEL, dtype: str = "bfloat16") -> str:
    """Write <model>_<digest12>/config.json as vLLM does; returns the folder name."""
    fields = {
        "model_name": model,
        "dtype": dtype,
        "tokens_per_hash": 16,
        "blocks_per_file": 1,
        "tp_size": 1,
        "pp_size": 1,
        "pcp_size": 1,
        "dcp_size": 1,
        "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["l0"]}],
        "inference_engine": "vllm",
    }
    canon = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    folder = f"{model.replace('/', '_')}_{hashlib.sha256(canon).hexdigest()[:12]}"
    (ns_dir / folder).mkdir(parents=True, exist_ok=True)
    (ns_dir / folder / "config.json").write_text(json.dumps(fields, indent=2, sort_keys=True))
    return folder


def block_path(folder: str, key: str, group: int = 0) -> str:
    """A block file's path below the namespace dir."""
    return f"{folder}_r0/{key[:3]}/{key[3:5]}_g{group}/{key}.bin"


def key(i: int, digits: int = 64) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()[:digits]


def write_blocks(
    ns_dir: Path,
    folder: str,
    n: int,
    *,
    size: int = SIZE,
    start: int = 0,
    mtime: float | None = None,
) -> list[str]:
    """n block files; their paths below the namespace dir."""
    paths = []
    for i in range(start, start + n):
        rel = block_path(folder, key(i))
        path = ns_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0" * size)
        if mtime is not None:
            os.utime(path, (mtime, mtime))
        paths.append(rel)
    return paths


def vllm_namespace(layout: Layout, store: Store, name: str = "vllm-a") -> str:
    """A namespace whose manifest names the vLLM engine (what `init -- vllm serve` writes)."""
    digest = hashlib.sha256(name.encode()).hexdigest()[:32]
    identity = {
        "engine": "vllm",
        "kv_cache_dtype": "bfloat16",
        "source": {"served_model_name": name},
    }
    ensure_namespace(
        layout, store, ns_id=digest[:16], digest=digest, identity=identity, now=time.time()
    )
    return digest[:16]


def vllm_tree(layout: Layout, store: Store) -> tuple[str, Path, str]:
    """A vLLM namespace with its identity folder written: (namespace id, its dir, folder)."""
    ns = vllm_namespace(layout, store)
    folder = write_folder(layout.ns_dir(ns))
    return ns, layout.ns_dir(ns), folder


def sibling(rel: str, fill: str = "f") -> str:
    """Another block's path in the hashed dir of block path `rel` (its name's first 5 digits
    name the dir)."""
    head, _, name = rel.rpartition("/")
    return f"{head}/{name[:5]}{fill * 59}.bin"


def vllm_store(ns_dir: Path, rel: str, size: int = SIZE) -> None:
    """Store a block as vLLM's fs tier does (tiering/fs/io.py): makedirs, an O_EXCL temp, one
    write, os.replace."""
    dest = ns_dir / rel
    os.makedirs(dest.parent, exist_ok=True)
    tmp = f"{dest}_{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"\x02" * size)
    finally:
        os.close(fd)
    os.replace(tmp, dest)


def vllm_load(ns_dir: Path, rel: str) -> int:
    """Read a block as vLLM does: os.open(O_RDONLY) + readv + close; the bytes read."""
    fd = os.open(ns_dir / rel, os.O_RDONLY)
    try:
        buf = bytearray(os.fstat(fd).st_size)
        return os.readv(fd, [buf])
    finally:
        os.close(fd)
