"""The SGLang side of bench/bench_replay.py: replays a trace through SGLang's own HiCacheFile.

Runs inside the .sglang-env (torch + sglang), one process per configuration, all TP ranks in it
(each rank its own `HiCacheFile`, as each rank of a server has). A request is served as
SGLang's cache controller serves it (sglang/srt/managers/cache_controller.py, 0.5.23):

* `_storage_hit_query`: `batch_exists` on batches of STORAGE_BATCH_SIZE page keys, stopping at
  the first batch that is not a full hit; the count is all-reduced with MIN over the ranks;
* `_page_transfer`: `batch_get` of that prefix in the same batches, counting pages up to the
  first one that did not load (a file deleted after `exists`), again MIN over the ranks;
* `_page_backup`: `batch_set` of the rest of the chain, batch by batch, stopping at a failed
  batch. `set` skips a key whose file exists (touching SGLang's evictor, not the mtime).

The job (a JSON file, argv[1]) names the trace file, the storage dir, the TP size, the speed
of the trace's clock (`rate`; 0: as fast as it goes) and the page size. The trace gives each
request's time in seconds (`times`): request i is served `times[i] / rate` s after the first
(a generated trace's requests are 1 s apart, so `rate` is its requests/s; a recorded one's are
its recorded arrivals, so `rate` is the speed-up). A request that falls behind is served at
once. Output is JSON lines on stdout: `{"restart": i}` before request `restart_at` (a
generated trace restarts halfway, a recorded one never: the driver then restarts what it must
and writes a line on stdin; the worker drops its backends and opens fresh ones, which seed
SGLang's LRU from the directory by mtime), then `{"result": {...}}`.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import sys
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheFile,
    HiCacheStorageConfig,
)

MODEL = "bench/replay"


def page_key(page: int) -> str:
    """A page's storage key: a sha256 hex string, as SGLang's chained page hashes are."""
    return hashlib.sha256(f"replay-page-{page}".encode()).hexdigest()


def open_ranks(storage_dir: str, tp: int) -> list[HiCacheFile]:
    """One HiCacheFile per TP rank, configured as SGLang configures them for a dense model."""
    out = []
    for rank in range(tp):
        cfg = HiCacheStorageConfig(
            tp_rank=rank,
            tp_size=tp,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=False,
            enable_storage_metrics=False,
            is_page_first_layout=True,
            model_name=MODEL,
            dcp_size=1,
            dcp_rank=0,
            logical_page_size=None,
        )
        out.append(HiCacheFile(cfg, file_path=storage_dir))
    return out


def batches(keys: list[str]) -> list[list[str]]:
    return [keys[i : i + STORAGE_BATCH_SIZE] for i in range(0, len(keys), STORAGE_BATCH_SIZE)]


def exists_prefix(backend: HiCacheFile, keys: list[str]) -> int:
    """`_storage_hit_query` on one rank."""
    hit = 0
    for batch in batches(keys):
        n = backend.batch_exists(batch)
        hit += n
        if n < len(batch):
            break
    return hit


def get_prefix(backend: HiCacheFile, keys: list[str], page: torch.Tensor) -> int:
    """`_page_transfer` on one rank: pages loaded before the first that failed."""
    done = 0
    for batch in batches(keys):
        got = backend.batch_get(batch, [torch.empty_like(page) for _ in batch])
        for g in got:
            if g is None:
                return done
            done += 1
    return done


def set_rest(backend: HiCacheFile, keys: list[str], page: torch.Tensor) -> bool:
    """`_page_backup` on one rank; False if a batch failed (the rest is then not written)."""
    return all(backend.batch_set(batch, [page] * len(batch)) for batch in batches(keys))


class Replay:
    def __init__(self, job: dict[str, Any]) -> None:
        with open(job["trace"]) as f:
            trace = json.load(f)
        self.parent: list[int] = trace["parent"]
        self.requests: list[list[int]] = trace["requests"]
        self.restart_at: int = trace["restart_at"]
        self.times: list[float] = trace["times"]
        self.dir: str = job["dir"]
        self.tp: int = job["tp"]
        self.rate: float = job["rate"]
        self.keys = [page_key(p) for p in range(len(self.parent))]
        self.page = torch.ones(job["page_bytes"] // 2, dtype=torch.bfloat16)
        self.hits = [0, 0]  # before / after the restart
        self.lookups = [0, 0]
        self.races = 0  # pages `exists` saw that `get` did not find (deleted in between)
        self.set_failures = 0

    def serve(self, ranks: list[HiCacheFile], i: int) -> None:
        chain = [self.keys[p] for p in self.requests[i]]
        hit = min(exists_prefix(b, chain) for b in ranks)
        loaded = min(get_prefix(b, chain[:hit], self.page) for b in ranks)
        self.races += hit - loaded
        half = int(i >= self.restart_at)
        self.hits[half] += loaded
        self.lookups[half] += len(chain)
        for b in ranks:
            self.set_failures += not set_rest(b, chain[loaded:], self.page)

    def run(self) -> dict[str, Any]:
        ranks = open_ranks(self.dir, self.tp)
        t0 = start = time.monotonic()
        paused = 0.0
        for i in range(len(self.requests)):
            if i == self.restart_at:
                ranks.clear()
                gc.collect()  # the old server's objects are gone before the new one starts
                pause = time.monotonic()
                print(json.dumps({"restart": i}), flush=True)
                if not sys.stdin.readline():
                    raise SystemExit("driver went away at the restart")
                ranks = open_ranks(self.dir, self.tp)
                paused += time.monotonic() - pause
                t0 += time.monotonic() - pause  # the schedule resumes where it stopped
            if self.rate > 0:
                delay = t0 + (self.times[i] - self.times[0]) / self.rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            self.serve(ranks, i)
        elapsed = time.monotonic() - start - paused
        on_disk, unusable = self.audit()
        return {
            "hits": self.hits,
            "lookups": self.lookups,
            "requests": len(self.requests),
            "elapsed": elapsed,
            "races": self.races,
            "set_failures": self.set_failures,
            "files_end": on_disk,
            "unusable_end": unusable,
        }

    def audit(self) -> tuple[int, int]:
        """Page files on disk at the end, and how many of them no request can load: a file is
        usable only if its page and every page before it in its chain are on every rank."""
        names = set(os.listdir(self.dir))
        suffixes = [f"_{MODEL.replace('/', '-')}_{r}_{self.tp}.bin" for r in range(self.tp)]
        present = [[f"{k}{suffix}" in names for k in self.keys] for suffix in suffixes]
        usable = [False] * len(self.parent)
        for p, par in enumerate(self.parent):  # a parent's id is below its child's
            usable[p] = all(r[p] for r in present) and (par < 0 or usable[par])
        on_disk = sum(sum(r) for r in present)
        return on_disk, sum(r[p] and not usable[p] for r in present for p in range(len(usable)))


def main() -> None:
    logging.disable(logging.WARNING)  # SGLang logs every miss at warning level
    with open(sys.argv[1]) as f:
        job = json.load(f)
    result = Replay(job).run()
    print(json.dumps({"result": result}), flush=True)


if __name__ == "__main__":
    main()
