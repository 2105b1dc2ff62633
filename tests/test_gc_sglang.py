"""GC against SGLang's own HiCacheFile: caps hold, recent prefixes keep hitting, deletions
SGLang races with are misses, and a torn page is healed."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from cachemgr.fs.leadership import Leadership
from cachemgr.gc.policy import GcPolicy
from cachemgr.gc.runner import GcRunner
from cachemgr.state.index import scan_root
from tests.conftest import SGLANG_ENV, SglangDriver
from tests.gc_helpers import NS, T0, Tree, big_disk, policy

pytestmark = pytest.mark.sglang
SUFFIX = "_Qwen-Qwen3-8B_0_1.bin"  # what HiCacheFile appends for this model on TP rank 0 of 1
PAGE_BYTES = 512 * 2  # elems=512 in bfloat16
SYS = [1, 256]  # a system prompt of 4 pages every session starts with


def session(s: int, turns: int) -> list[list[int]]:
    """The token segments of session s after `turns` turns of 2 pages each."""
    return [SYS, *[[1000 * s + t, 128] for t in range(turns)]]


class Workload:
    """Sessions driven through SGLang's HiCacheFile, their accesses fed to the index in the
    order SGLang made them (what the daemon's watcher records), with a GC check per turn."""

    def __init__(self, sglang: SglangDriver, tree: Tree, runner: GcRunner) -> None:
        self.sglang, self.tree, self.runner = sglang, tree, runner
        self.dir = tree.dir(NS)
        self.h = sglang.open(self.dir)
        self.keys: dict[int, list[str]] = {}
        self.now = T0

    def turn(self, s: int, turns: int) -> dict[str, Any]:
        tokens = session(s, turns)
        got = self.sglang.read(self.h, tokens)
        hit = [k + SUFFIX for k in self.keys.get(s, [])[: got["hit_pages"]]]
        self.tree.read(NS, hit, at=self.now)
        before = set(os.listdir(self.dir))
        self.keys[s] = self.sglang.write(self.h, tokens)["keys"]
        new = [k + SUFFIX for k in self.keys[s] if k + SUFFIX not in before]
        self.tree.stored(NS, new, at=self.now)
        return got

    def on_disk(self) -> int:
        return sum(e.stat().st_size for e in os.scandir(self.dir) if e.name.endswith(".bin"))

    def stranded(self, s: int) -> list[str]:
        """Pages of session s on disk after one of its earlier pages went: unusable."""
        present = [os.path.exists(self.dir / (k + SUFFIX)) for k in self.keys[s]]
        first_gap = present.index(False) if False in present else len(present)
        return [k for k, p in zip(self.keys[s][first_gap:], present[first_gap:], strict=True) if p]


def test_cap_holds_and_recent_prefixes_keep_hitting(sglang: SglangDriver, root: Path) -> None:
    cap = 48 * PAGE_BYTES
    pol = policy(max_bytes=cap, min_age=5, sweep_interval=1e9)
    tree = Tree.at(root)
    now = [time.time()]  # SGLang's files get real mtimes: the fake clock runs ahead of them
    runner = GcRunner(tree.layout, tree.store, pol, clock=lambda: now[0], disk_usage=big_disk)
    work = Workload(sglang, tree, runner)
    schedule = []  # two sessions at a time: s's first 4 turns alternate with s-1's last 4
    for s in range(9):
        for t in range(4):
            schedule += [(s, t)] + ([(s - 1, 4 + t)] if s else [])
    schedule += [(8, 4 + t) for t in range(4)]
    written = 0
    for step, (s, t) in enumerate(schedule):
        now[0] = work.now = now[0] + 10
        got = work.turn(s, t + 1)
        written += 2
        runner.tick()
        assert work.on_disk() <= cap * pol.high_watermark, f"step {step}"
        # the session just served finds its whole history on disk: recent pages survive
        assert sglang.read(work.h, session(s, t + 1))["hit_pages"] == 4 + 2 * (t + 1)
        assert got["errors"] == [] and got["hit_pages"] == (4 + 2 * t if step else 0)
        for old in work.keys:
            assert work.stranded(old) == [], f"session {old} has unusable pages at step {step}"
    assert written * PAGE_BYTES >= 3 * cap  # the workload wrote 3x the cap
    assert all(not os.path.exists(work.dir / (k + SUFFIX)) for k in work.keys[0][4:])
    runner.leadership.release()
    tree.store.close()


def test_a_torn_page_is_removed_and_sglang_heals(sglang: SglangDriver, root: Path) -> None:
    tree = Tree.at(root)
    d = tree.dir(NS)
    h = sglang.open(d)
    tokens = session(7, 3)  # 10 pages
    keys = sglang.write(h, tokens)["keys"]
    with open(d / (keys[4] + SUFFIX), "r+b") as f:
        f.truncate(PAGE_BYTES // 2)  # a crash without fsync, or a foreign-dtype writer
    assert sglang.read(h, tokens)["errors"]  # SGLang: short read, the batch is a miss
    assert sglang.write(h, tokens)["stored"] == 0  # and it never rewrites a file that exists
    now = time.time() + 1
    scan_root(tree.layout, tree.store, now=lambda: now)
    runner = GcRunner(tree.layout, tree.store, policy(), clock=lambda: now, disk_usage=big_disk)
    report = runner.run(actor="cli")
    assert report.totals() == {"corrupt": (1, PAGE_BYTES // 2)}
    got = sglang.read(h, tokens)
    assert (got["hit_pages"], got["errors"]) == (4, [])  # a gap in the chain is a plain miss
    assert sglang.write(h, tokens)["stored"] == 1
    assert sglang.read(h, tokens)["correct"] == 10
    runner.leadership.release()
    tree.store.close()


RACE = """
import json, sys, torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
cfg = HiCacheStorageConfig(
    tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
    is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
    model_name="m", dcp_size=1, dcp_rank=0, logical_page_size=None)
b = HiCacheFile(cfg, file_path=sys.argv[1])
keys = ["%064x" % i for i in range(3)]
for k in keys:
    b.set(k, torch.ones(512, dtype=torch.bfloat16))
print(json.dumps({"exists": [b.exists(k) for k in keys]}), flush=True)
sys.stdin.readline()  # GC deletes now: after SGLang's exists(), before its get()
got = b.batch_get(keys, [torch.empty(512, dtype=torch.bfloat16) for _ in keys])
print(json.dumps({"got": [g is not None for g in got]}), flush=True)
"""


def test_a_page_deleted_between_exists_and_get_is_a_miss(root: Path) -> None:
    tree = Tree.at(root)
    d = tree.dir(NS)
    proc = subprocess.Popen(
        [str(SGLANG_ENV / "bin" / "python"), "-c", RACE, str(d)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")},
    )
    assert proc.stdin is not None and proc.stdout is not None
    assert json.loads(proc.stdout.readline()) == {"exists": [True, True, True]}
    now = time.time() + 1
    scan_root(tree.layout, tree.store, now=lambda: now)
    names = [f"{i:064x}_m_0_1.bin" for i in range(3)]
    # The stores as the watcher reports them, head to tail: the index learns the chain's links
    # (pages known only from a scan have none, and are ordered by their use alone).
    tree.stored(NS, names, at=now)
    tree.read(NS, names, at=now)  # read in chain order
    runner = GcRunner(
        tree.layout,
        tree.store,
        GcPolicy(max_bytes=2 * PAGE_BYTES, min_age=0, delete_rate=None),
        clock=lambda: now + 10,
        disk_usage=big_disk,
        leadership=Leadership(root / "gc.lock"),
    )
    assert runner.run(actor="auto").files == 2  # down to 85% of 2 pages: the tail two go
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline()) == {"got": [True, False, False]}
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0
    proc.stdout.close()
    runner.leadership.release()
    tree.store.close()


CHURN = """
import json, os, sys, threading, torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
cfg = HiCacheStorageConfig(
    tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
    is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
    model_name="m", dcp_size=1, dcp_rank=0, logical_page_size=None)
d = sys.argv[1]
b = HiCacheFile(cfg, file_path=d)
keys = ["%064x" % i for i in range(32)]
def value(i):
    return torch.arange(256 * 1024, dtype=torch.float32) + i  # 1 MiB: reads take a while
for i, k in enumerate(keys):
    b.set(k, value(i))
# A page unlinked while SGLang holds it open reads whole (the inode lives until closed):
path = os.path.join(d, keys[0] + "_m_0_1.bin")
f = open(path, "rb", buffering=0)
os.unlink(path)
whole = f.read() == value(0).numpy().tobytes()
f.close()
b.set(keys[0], value(0))
# Deleting pages as fast as possible while the server reads them (GC with min_age 0):
stop = threading.Event()
def delete():
    while not stop.is_set():
        for k in keys:
            try:
                os.unlink(os.path.join(d, k + "_m_0_1.bin"))
            except FileNotFoundError:
                pass
            b.set(k, value(keys.index(k)))  # the server writes it again (temp + rename)
t = threading.Thread(target=delete)
t.start()
hits = misses = wrong = 0
for _ in range(30):
    got = b.batch_get(keys, [torch.empty(256 * 1024, dtype=torch.float32) for _ in keys])
    for i, g in enumerate(got):
        if g is None:
            misses += 1
        elif torch.equal(g, value(i)):
            hits += 1
        else:
            wrong += 1
stop.set()
t.join()
print(json.dumps({"whole": whole, "hits": hits, "misses": misses, "wrong": wrong}), flush=True)
"""


def test_min_age_zero_is_safe_deleting_under_sglang_reads_is_a_miss(tmp_path: Path) -> None:
    """Why gc_min_age defaults to 0: SGLang writes a page to a temp file and renames it (never
    a torn page), and a page deleted while it is being read reads whole; deleted before the
    open, it is a miss. So deleting a page whatever its age never gives SGLang wrong bytes."""
    out = subprocess.run(
        [str(SGLANG_ENV / "bin" / "python"), "-c", CHURN, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["whole"] is True
    assert got["wrong"] == 0  # never a short or foreign read passed off as a page
    assert got["hits"] > 0 and got["misses"] > 0  # both happened: the race was real
