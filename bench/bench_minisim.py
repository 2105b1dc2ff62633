"""The cost of the eviction orders' miniature caches (cachemgr.gc.minisim): time per access
(the index thread's calls into cachemgr.gc.adapt, and a GC plan's choice every 1,000
accesses) and peak memory, for a cache whose every page is in the sample (the worst case:
up to MINI_PAGES pages) and for large caches sampled at 2^-k.

    .venv/bin/python bench/bench_minisim.py [--accesses N]
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc
import zlib

from cachemgr.gc.adapt import Adaptive

CACHES = (8_192, 131_072, 1_048_576)  # pages on disk at the plans


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
    print("| pages on disk | sample rate | pages in the sample | µs per access | peak memory |")
    print("| --- | --- | --- | --- | --- |")
    for cache in CACHES:
        us, peak, pages, shift = run(cache, args.accesses)
        print(f"| {cache:,} | 1/{1 << shift} | {pages:,} | {us:.2f} | {peak / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main()
