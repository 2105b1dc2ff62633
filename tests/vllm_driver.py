"""Drives vLLM's own file-system KV tier (FileSystemTierManager) for cachemgr; runs inside
.vllm-env (scripts/vllm-env.sh). Not part of the pytest suite yet (docs/vllm-notes.md).

It speaks JSON lines on stdin/stdout like tests/sglang_driver.py, so one process (vLLM's
import takes 10-20 s here) serves many requests. Requests and replies:
  open:   root_dir, model, dtype, block_tokens, tp_size, pp_size, block_bytes, slots,
          layers, hash -> handle, base_path, config_path, block_dir, o_direct, c_io
  store:  handle, tokens [[seed, n], ...], tag -> keys, paths, stored, skipped, failed
  lookup: handle, tokens, req -> hit, miss, retry_rounds (vLLM's async lookup, resolved)
  load:   handle, tokens, tag, req -> loaded, correct, wrong, failed_at, job_success,
          lookup_after (the tier's own verdict for each key once the load finished)
  close:  handle -> {} (shutdown; a later open on the same root_dir is a restart)
  unlink: handle, tokens, index -> path (deletes that block's file, as an evictor would)
  files:  root_dir -> bin, tmp, config, other (regular files below root_dir, by kind)
Run `python tests/vllm_driver.py --demo ROOT_DIR` for the scenarios in docs/vllm-notes.md.
Block keys are vLLM's own chained block hashes (hash_block_tokens; NONE_HASH is re-seeded at
each open: fixed for sha256, random for xxhash unless PYTHONHASHSEED is set); a block's
bytes are a deterministic function of (key, tag), so a reader can tell its own bytes from
another writer's.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import random
import sys
import time
import zlib
from typing import Any

import numpy as np
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingSpec,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.fs import io as fs_io
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

GROUP = 0  # one KV cache group: a plain full-attention model


class DriverSpec(OffloadingSpec):
    """The real OffloadingSpec base (the tier reads .config, .blocks_per_chunk and
    .kv_events_config from it); the scheduler/worker halves are not needed here."""

    def get_manager(self) -> Any:
        raise NotImplementedError

    def get_worker(self, kv_caches: Any) -> Any:
        raise NotImplementedError


class Tier:
    def __init__(self, req: dict[str, Any]) -> None:
        self.hash_fn = get_hash_fn_by_name(req.get("hash", "sha256"))
        kv_cache_utils.init_none_hash(self.hash_fn)
        self.block_tokens = req.get("block_tokens", 16)
        self.block_bytes = req.get("block_bytes", 4096)
        # The primary (CPU) tier's memory: one row per chunk slot. vLLM's is an mmap region
        # (page-aligned), which O_DIRECT writes need; a plain numpy array fails with EINVAL.
        slots = req.get("slots", 64)
        self.region = mmap.mmap(-1, slots * self.block_bytes)
        self.primary = np.frombuffer(self.region, dtype=np.uint8).reshape(slots, -1)
        self.job_id = 0
        cfg = OffloadingConfig(
            groups=(
                OffloadingGroupConfig(
                    tokens_per_block=self.block_tokens,
                    layer_names=tuple(req.get("layers", ["model.layers.0.self_attn.attn"])),
                    group_id=GROUP,
                ),
            ),
            worker_kv_bytes_per_block=self.block_bytes // req.get("tp_size", 1),
            enable_kv_cache_events=False,
            extra_config={},
            engine_id="cachemgr-driver",
            model=OffloadingModelConfig(name=req["model"], dtype=req.get("dtype", "bfloat16")),
            cache=OffloadingCacheConfig(tokens_per_hash=self.block_tokens, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(
                rank=0,  # the fs tier runs in the scheduler, where rank is 0
                world_size=req.get("tp_size", 1) * req.get("pp_size", 1),
                tp_size=req.get("tp_size", 1),
                pp_size=req.get("pp_size", 1),
                pcp_size=1,
                dcp_size=1,
                data_parallel_index=0,
                data_parallel_size=1,
                data_parallel_rank_local=None,
                is_parallelism_agnostic=req.get("parallel_agnostic", False),
            ),
        )
        self.tier = FileSystemTierManager(
            offloading_spec=DriverSpec(cfg),
            primary_kv_view=memoryview(self.primary),
            tier_type="fs",
            root_dir=req["root_dir"],
            n_read_threads=2,
            n_write_threads=2,
        )

    def keys(self, segments: list[list[int]]) -> list[bytes]:
        tokens: list[int] = []
        for seed, n in segments:
            rng = random.Random(seed)
            tokens.extend(rng.randrange(150_000) for _ in range(n))
        out: list[bytes] = []
        parent = None
        for start in range(0, len(tokens) - self.block_tokens + 1, self.block_tokens):
            chunk = tokens[start : start + self.block_tokens]
            parent = kv_cache_utils.hash_block_tokens(self.hash_fn, parent, chunk)
            out.append(make_offload_key(parent, GROUP))
        return out

    def value(self, key: bytes, tag: str) -> np.ndarray:
        rng = np.random.default_rng(zlib.crc32(key + tag.encode()))
        return rng.integers(0, 256, self.block_bytes, dtype=np.uint8)

    def run_job(self, keys: list[bytes], req_id: str, load: bool) -> Any:
        """Submit one job over slots 0..n-1 and wait for its JobResult."""
        self.job_id += 1
        job = TransferJob(
            job_id=self.job_id,
            keys=keys,
            chunk_ids=np.arange(len(keys), dtype=np.int64),
            is_promotion=load,
            req_context=ReqContext(req_id=req_id),
        )
        (self.tier.submit_load if load else self.tier.submit_store)(job)
        self.tier.drain_jobs()
        results = [r for r in self.tier.get_finished_jobs() if r.job_id == self.job_id]
        return results[0]

    def lookup(self, keys: list[bytes], ctx: ReqContext) -> tuple[list[LookupResult], int]:
        """vLLM's lookup is asynchronous: RETRY until a scheduler step flushes the batch to
        the lookup thread and a later call drains its verdict."""
        for rounds in range(200):
            verdicts = [self.tier.lookup(k, ctx) for k in keys]
            if LookupResult.RETRY not in verdicts:
                return verdicts, rounds
            self.tier.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
            time.sleep(0.01)
        raise TimeoutError("lookup never resolved")


tiers: list[Tier] = []
contexts: dict[str, ReqContext] = {}


def ctx_of(req: dict[str, Any]) -> ReqContext:
    # Requests live until the caller closes the tier: their cached lookup verdicts are
    # what a running server holds while a file is deleted under it.
    return contexts.setdefault(req.get("req", "r0"), ReqContext(req_id=req.get("req", "r0")))


def op_open(req: dict[str, Any]) -> dict[str, Any]:
    t = Tier(req)
    tiers.append(t)
    mapper = t.tier.file_mapper
    return {
        "handle": len(tiers) - 1,
        "base_path": mapper.base_path,
        "config_path": mapper.get_config_file_path(),
        "block_dir": f"{mapper.base_path}_r{mapper.rank}",
        "o_direct": t.tier._use_o_direct,
        "c_io": fs_io._HAS_FSIO_C,
    }


def op_store(req: dict[str, Any]) -> dict[str, Any]:
    t = tiers[req["handle"]]
    keys = t.keys(req["tokens"])
    paths = [t.tier.file_mapper.get_file_name(k) for k in keys]
    existed = [os.path.exists(p) for p in paths]
    for slot, key in enumerate(keys):
        t.primary[slot] = t.value(key, req.get("tag", "a"))
    result = t.run_job(keys, f"store-{t.job_id}", load=False)
    now = [os.path.exists(p) for p in paths]
    return {
        "keys": [k.hex() for k in keys],
        "paths": paths,
        "stored": sum(n and not e for n, e in zip(now, existed, strict=True)),
        "skipped": sum(existed),
        "failed": sum(not n for n in now),
        "name_hex_digits": sorted({len(os.path.basename(p)) - len(".bin") for p in paths}),
        "job_success": result.success,
    }


def op_lookup(req: dict[str, Any]) -> dict[str, Any]:
    t = tiers[req["handle"]]
    verdicts, rounds = t.lookup(t.keys(req["tokens"]), ctx_of(req))
    hit = sum(v is LookupResult.HIT for v in verdicts)
    return {"hit": hit, "miss": len(verdicts) - hit, "retry_rounds": rounds}


def op_load(req: dict[str, Any]) -> dict[str, Any]:
    t = tiers[req["handle"]]
    keys = t.keys(req["tokens"])
    t.primary[: len(keys)] = 0
    result = t.run_job(keys, ctx_of(req).req_id, load=True)
    done = (
        len(keys)
        if result.success
        else len(result.successful_keys or ())  # the prefix before the failing file
    )
    correct = sum(
        np.array_equal(t.primary[i], t.value(k, req.get("tag", "a")))
        for i, k in enumerate(keys[:done])
    )
    after = [t.tier.lookup(k, ctx_of(req)).name for k in keys]
    return {
        "loaded": done,
        "correct": correct,
        "wrong": done - correct,
        "failed_at": None if result.success else done,
        "job_success": result.success,
        "lookup_after": after,
    }


def op_close(req: dict[str, Any]) -> dict[str, Any]:
    tiers[req["handle"]].tier.shutdown()
    return {}


def op_unlink(req: dict[str, Any]) -> dict[str, Any]:
    t = tiers[req["handle"]]
    path = t.tier.file_mapper.get_file_name(t.keys(req["tokens"])[req["index"]])
    os.unlink(path)
    return {"path": path}


def op_files(req: dict[str, Any]) -> dict[str, Any]:
    counts = {"bin": 0, "tmp": 0, "config": 0, "other": 0}
    for _dir, _subdirs, names in os.walk(req["root_dir"]):
        for name in names:
            kind = name.rsplit(".", 1)[-1] if "." in name else "other"
            kind = "config" if name == "config.json" else kind
            counts[kind if kind in counts else "other"] += 1
    return counts


OPS = {
    "open": op_open,
    "store": op_store,
    "lookup": op_lookup,
    "load": op_load,
    "close": op_close,
    "unlink": op_unlink,
    "files": op_files,
}


def demo(root: str) -> list[dict[str, Any]]:
    """Round trip, restart, a file deleted under a running reader, another identity."""
    model = {"root_dir": root, "model": "Qwen/Qwen3-0.6B", "block_tokens": 16}
    prompt = [[1, 64]]  # 4 blocks of 16 tokens
    return [
        {"op": "open", **model, "dtype": "bfloat16"},
        {"op": "store", "handle": 0, "tokens": prompt, "tag": "a"},
        {"op": "lookup", "handle": 0, "tokens": prompt, "req": "q1"},
        {"op": "load", "handle": 0, "tokens": prompt, "tag": "a", "req": "q1"},
        {"op": "store", "handle": 0, "tokens": prompt, "tag": "a"},
        {"op": "close", "handle": 0},
        # Restart: a new manager on the same root_dir finds and loads the same files.
        {"op": "open", **model, "dtype": "bfloat16"},
        {"op": "lookup", "handle": 1, "tokens": prompt, "req": "q2"},
        {"op": "load", "handle": 1, "tokens": prompt, "tag": "a", "req": "q2"},
        # Block 2's file goes while q2 still holds its HIT verdict: the load fails there.
        {"op": "unlink", "handle": 1, "tokens": prompt, "index": 2},
        {"op": "load", "handle": 1, "tokens": prompt, "tag": "a", "req": "q2"},
        {"op": "lookup", "handle": 1, "tokens": prompt, "req": "q3"},
        {"op": "close", "handle": 1},
        # Another KV dtype is another digest folder: nothing of the first is found.
        {"op": "open", **model, "dtype": "fp8_e4m3"},
        {"op": "lookup", "handle": 2, "tokens": prompt, "req": "q4"},
        {"op": "close", "handle": 2},
        # xxhash block hashes: 32 hex digits, and NONE_HASH is seeded at random per
        # init_none_hash unless PYTHONHASHSEED is set, so a restart finds nothing.
        {"op": "open", **model, "dtype": "bfloat16", "hash": "xxhash"},
        {"op": "store", "handle": 3, "tokens": prompt, "tag": "a"},
        {"op": "close", "handle": 3},
        {"op": "open", **model, "dtype": "bfloat16", "hash": "xxhash"},
        {"op": "lookup", "handle": 4, "tokens": prompt, "req": "q5"},
        {"op": "close", "handle": 4},
        {"op": "files", "root_dir": root},
    ]


def serve(requests: Any) -> None:
    for line in requests:
        req = json.loads(line) if isinstance(line, str) else line
        try:
            resp = OPS[req["op"]](req)
        except Exception as e:  # report to the caller instead of dying mid-protocol
            resp = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps({"op": req["op"], **resp}), flush=True)


def main() -> None:
    logging.disable(logging.ERROR)  # a failed load is logged at error level by the pool
    print(json.dumps({"ready": True}), flush=True)
    if sys.argv[1:2] == ["--demo"]:
        serve(demo(sys.argv[2]))
    else:
        serve(sys.stdin)


if __name__ == "__main__":
    main()
