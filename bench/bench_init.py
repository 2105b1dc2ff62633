"""Re-running init with an unchanged identity: milliseconds on a warm digest cache.

Builds a real safetensors model (default 512 MB), runs init cold (every weight hashed) and then
warm (digests reused by (dev, inode, size, mtime)), and compares with `sha256sum` of the same
files — what a fingerprint without a cache would pay on every start. Usage:
python bench/bench_init.py [MODEL_MB]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from cachemgr.identity.digest_cache import DigestCache
from cachemgr.identity.fingerprint import IdentityOptions
from cachemgr.layout import Layout
from cachemgr.ns.prelaunch import init_namespace
from cachemgr.sglang.args import resolve_launch_args
from cachemgr.sglang.identity import compute_identity
from cachemgr.state.store import Store

HOUR_AGO = time.time() - 3600


def make_model(path: Path, megabytes: int) -> list[Path]:
    path.mkdir()
    shards = max(1, megabytes // 128)
    rows = megabytes * 2**20 // shards // (4 * 1024)
    rng = np.random.default_rng(0)
    files = []
    for i in range(shards):
        f = path / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({f"w{i}": rng.standard_normal((rows, 1024), dtype=np.float32)}, str(f))
        files.append(f)
    (path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    for entry in path.iterdir():  # as if downloaded earlier: fresh files are never cached
        os.utime(entry, (HOUR_AGO, HOUR_AGO))
    return files


def init_once(layout: Layout, model: Path) -> float:
    t = time.perf_counter()
    store = Store.open(layout.db_path)
    try:
        args = resolve_launch_args(f"sglang serve --model-path {model} --page-size 64")
        ident = compute_identity(
            args, IdentityOptions(engine_version="0.5.23"), cache=DigestCache(store)
        )
        init_namespace(layout, store, ident)
    finally:
        store.close()
    return time.perf_counter() - t


def main() -> None:
    megabytes = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        files = make_model(Path(tmp) / "model", megabytes)
        layout = Layout.at(Path(tmp) / "root")
        cold = init_once(layout, Path(tmp) / "model")
        warm = statistics.median(init_once(layout, Path(tmp) / "model") for _ in range(20))
        t = time.perf_counter()
        subprocess.run(["sha256sum", *map(str, files)], check=True, capture_output=True)
        peer = time.perf_counter() - t
    print(f"model: {megabytes} MB in {len(files)} safetensors shards")
    print(f"init, cold digest cache (hash everything): {cold * 1000:9.1f} ms")
    print(f"init, unchanged identity, warm cache:       {warm * 1000:9.1f} ms (median of 20)")
    print(f"sha256sum of the same files (page cache):  {peer * 1000:9.1f} ms")
    print(f"  -> an unchanged init is {peer / warm:,.0f}x faster than re-hashing with sha256sum")


if __name__ == "__main__":
    main()
