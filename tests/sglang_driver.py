"""Drives SGLang's own HiCacheFile class for cachemgr's tests; runs inside .sglang-env.

It speaks JSON lines on stdin/stdout so one process (torch and sglang import in ~2 s) serves a
whole test session. Requests and replies:
  open:  dir, model, tp_rank, tp_size, mla, pp_rank, pp_size, cp_rank, cp_size -> handle
  write: handle, tokens [[seed, n], ...], page_size, dtype, elems, tag, pool
         -> keys, stored, skipped, failed
  read:  the same fields -> hit_pages, read, correct, wrong, errors
  pools: -> names (PoolName's values: the extra memory pools a page may have files for)
Page keys are SGLang's own chained page hashes of the token ids; a page's bytes are a
deterministic function of (key, tag, dtype) so a reader can tell its own bytes from others'.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import zlib
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig, PoolName
from sglang.srt.mem_cache.utils import get_hash_str

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
backends: list[HiCacheFile] = []


def tokens_of(segments: list[list[int]]) -> list[int]:
    out: list[int] = []
    for seed, n in segments:
        rng = random.Random(seed)
        out.extend(rng.randrange(150_000) for _ in range(n))
    return out


def page_keys(segments: list[list[int]], page_size: int) -> list[str]:
    tokens = tokens_of(segments)
    usable = len(tokens) - len(tokens) % page_size
    keys = get_hash_str(tokens[:usable], None, page_size=page_size)
    return list(keys) if isinstance(keys, list) else [keys]


def page_value(key: str, tag: str, dtype: str, elems: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{key}/{tag}".encode()))
    return torch.randn(elems, generator=gen).to(DTYPES[dtype])


def storage_key(key: str, pool: str | None) -> str:
    return key if pool is None else f"{key}.{pool}"


def op_open(req: dict[str, Any]) -> dict[str, Any]:
    cfg = HiCacheStorageConfig(
        tp_rank=req.get("tp_rank", 0),
        tp_size=req.get("tp_size", 1),
        pp_rank=req.get("pp_rank", 0),
        pp_size=req.get("pp_size", 1),
        attn_cp_rank=req.get("cp_rank", 0),
        attn_cp_size=req.get("cp_size", 1),
        is_mla_model=req.get("mla", False),
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=req["model"],
        dcp_size=req.get("dcp_size", 1),
        dcp_rank=req.get("dcp_rank", 0),
        logical_page_size=req.get("logical_page_size"),
    )
    backends.append(HiCacheFile(cfg, file_path=req["dir"]))
    return {"handle": len(backends) - 1}


def op_write(req: dict[str, Any]) -> dict[str, Any]:
    backend = backends[req["handle"]]
    keys = page_keys(req["tokens"], req["page_size"])
    stored = skipped = failed = 0
    for key in keys:
        skey = storage_key(key, req.get("pool"))
        existed = backend.exists(skey)
        ok = backend.set(skey, page_value(key, req["tag"], req["dtype"], req["elems"]))
        if not ok:
            failed += 1
        elif existed:
            skipped += 1
        else:
            stored += 1
    return {"keys": keys, "stored": stored, "skipped": skipped, "failed": failed}


def op_read(req: dict[str, Any]) -> dict[str, Any]:
    """Read like SGLang's prefetch: the longest contiguous prefix on disk, front to back."""
    backend = backends[req["handle"]]
    keys = page_keys(req["tokens"], req["page_size"])
    skeys = [storage_key(k, req.get("pool")) for k in keys]
    hit_pages = next((i for i, k in enumerate(skeys) if not backend.exists(k)), len(skeys))
    read = correct = wrong = 0
    errors: list[str] = []
    for key, skey in zip(keys[:hit_pages], skeys[:hit_pages], strict=True):
        target = torch.empty(req["elems"], dtype=DTYPES[req["dtype"]])
        try:
            got = backend.get(skey, target)
        except OSError as e:  # a short read: SGLang counts the whole batch as a miss
            errors.append(str(e))
            continue
        if got is None:
            continue
        read += 1
        want = page_value(key, req["tag"], req["dtype"], req["elems"])
        same = torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        correct += same
        wrong += not same
    return {
        "hit_pages": hit_pages,
        "read": read,
        "correct": correct,
        "wrong": wrong,
        "errors": errors,
    }


def op_pools(req: dict[str, Any]) -> dict[str, Any]:
    return {"names": [p.value for p in PoolName]}


OPS = {"open": op_open, "write": op_write, "read": op_read, "pools": op_pools}


def main() -> None:
    logging.disable(logging.WARNING)  # SGLang logs every miss at warning level
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            resp = OPS[req["op"]](req)
        except Exception as e:  # report to the test instead of dying mid-protocol
            resp = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(resp), flush=True)


if __name__ == "__main__":
    main()
