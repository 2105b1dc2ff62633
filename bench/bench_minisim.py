"""The cost of the eviction orders' miniature caches (cachemgr.gc.minisim): time per access
(the index thread's calls into cachemgr.gc.adapt, and a GC plan's choice every 1,000
accesses) and peak memory, for caches whose every page is in the sample (the worst case:
up to MINI_PAGES pages) and for large caches sampled at 2^-k; beside it, what the chain
model's own learning costs an access (cachemgr.gc.chains observe_read / observe_write, the
miniatures left out), the index thread's other work on the same event.

    .venv/bin/python bench/bench_minisim.py [--accesses N]
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc
import zlib

from cachemgr.gc.adapt import Adaptive
from cachemgr.gc.chains import ChainModel

CACHES = (3_000, 8_192, 30_000, 131_072, 1_048_576)  # pages on disk at the plans


def _stream(cache: int, accesses: int, seed: int) -> list[tuple[int, bool]]:
    """(key digest, read) per access: half of them over a hot set of half the cache, half
    over a working set four times the cache; one in three a store."""
    rng = random.Random(seed)
    keys = [zlib.crc32(b"%d" % i) for i in range(4 * cache)]
    hot = cache // 2
    return [
        (keys[rng.randrange(hot) if rng.random() < 0.5 else rng.randrange(len(keys))], i % 3 > 0)
        for i in range(accesses)
    ]


def _feed(adapt: Adaptive, stream: list[tuple[int, bool]], cache: int) -> None:
    for i, (k, read) in enumerate(stream):
        if read:
            adapt.read(k, i)
        else:
            adapt.stored(k, i, True)
        if i % 1000 == 0:
            adapt.choose(cache, i)


def _model_cost(stream: list[tuple[int, bool]]) -> float:
    """µs an access of the chain model's observe calls, its miniatures left out: a read of a
    page on disk, else a store of it."""
    model = ChainModel()
    model.adapt.stored = model.adapt.read = lambda *a, **k: None  # type: ignore[method-assign]
    names = {k: f"{k:064x}-0" for k, _ in stream}
    on_disk: set[int] = set()
    t0 = time.perf_counter()
    for i, (k, read) in enumerate(stream, 1):
        if read and k in on_disk:
            model.observe_read("ns", names[k], 64, seq=i, at=float(i))
        else:
            model.observe_write("ns", names[k], 64, seq=i, at=float(i))
            on_disk.add(k)
    return (time.perf_counter() - t0) / len(stream) * 1e6


def run(cache: int, accesses: int, seed: int = 1) -> tuple[float, int, int, int]:
    """(µs per access, peak traced bytes, pages in the sample, the sample's shift)."""
    stream = _stream(cache, accesses, seed)
    adapt = Adaptive()
    t0 = time.perf_counter()
    _feed(adapt, stream, cache)
    took = time.perf_counter() - t0
    tracemalloc.start()
    _feed(Adaptive(), stream, cache)  # (again, traced: tracing slows it down)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return took / accesses * 1e6, peak, len(adapt.mini.pages), adapt.mini.shift


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--accesses", type=int, default=1_000_000)
    args = ap.parse_args()
    print(
        "| pages on disk | sample rate | pages in the sample | µs per access | peak memory"
        " | chain model's own µs per access |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for cache in CACHES:
        us, peak, pages, shift = run(cache, args.accesses)
        model = _model_cost(_stream(cache, min(args.accesses, 200_000), 1))
        print(
            f"| {cache:,} | 1/{1 << shift} | {pages:,} | {us:.2f} | {peak / 2**20:.1f} MiB"
            f" | {model:.2f} |"
        )


if __name__ == "__main__":
    main()
