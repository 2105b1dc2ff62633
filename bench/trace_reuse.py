"""What an online policy could know about a page when it is stored (issue 21): a recorded
trace's reuse, the share of it that a page's birth predicts, and what knowing it would be worth.

    .venv/bin/python bench/trace_reuse.py bench/traces/conversation_trace.jsonl.gz [--caps 20,10]

The clairvoyant peer of bench/sim_policy.py reaches the no-cap hit ratio at every cap of the
recorded traces: all of its headroom over LRU is knowing which pages will never be read again.
This prints how many those are, P(reused) by what is known at a page's first store (how often
the page it branches from was read before, how long the request's hit prefix was), and three
page LRUs on the same requests (each request's longest cached prefix is a hit, the rest stored,
the least recently used pages evicted at the cap): plain; never storing a page no later request
reads (the admission oracle: a bound on any predictor of reuse at birth); and never storing a
page born behind a branch point read at most `--branch-reads` times before (the best birth
signal found), with the reused pages that rule lost.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_trace import TraceError, read_trace

Request = tuple[int, ...]


@dataclass(frozen=True)
class Birth:
    """What is known when a page is first stored."""

    branch_reads: int  # accesses of the page it follows before this request (0: a chain's first)
    prefix_hit: int  # pages of the request's prefix stored before it


def births(requests: list[Request]) -> dict[int, Birth]:
    seen: Counter[int] = Counter()
    out: dict[int, Birth] = {}
    for req in requests:
        k = known_prefix(req, seen)
        branch = seen[req[k - 1]] if k else 0
        for page in req[k:]:
            out.setdefault(page, Birth(branch, k))
        seen.update(req)
    return out


def known_prefix(req: Request, held: Counter[int] | OrderedDict[int, None]) -> int:
    k = 0
    while k < len(req) and req[k] in held:
        k += 1
    return k


def low_end(n: int) -> int:
    """The bucket of n: 0 to 3 alone, then powers of two (4-7, 8-15, ...), by its low end."""
    return n if n < 4 else 1 << (n.bit_length() - 1)


def bucket(low: int) -> str:
    return str(low) if low < 4 else f"{low}-{2 * low - 1}"


def reuse_by(
    born: dict[int, Birth], uses: Counter[int], key: Callable[[Birth], int]
) -> list[tuple[str, int, float]]:
    """(bucket, pages, P(read again)) by a feature of the page's birth."""
    pages: Counter[int] = Counter()
    reused: Counter[int] = Counter()
    for page, birth in born.items():
        b = low_end(key(birth))
        pages[b] += 1
        reused[b] += uses[page] > 1
    return [(bucket(b), pages[b], reused[b] / pages[b]) for b in sorted(pages)]


def lru(requests: list[Request], cap: int, admit: Callable[[int, int], bool]) -> float:
    """Page LRU's hit ratio; a page is stored the first time only if `admit(page, branch_reads)`."""
    held: OrderedDict[int, None] = OrderedDict()
    seen: Counter[int] = Counter()
    hits = total = 0
    for req in requests:
        k = known_prefix(req, held)
        hits += k
        total += len(req)
        branch = seen[req[known_prefix(req, seen) - 1]] if req[0] in seen else 0
        for page in req:
            if page in held:
                held.move_to_end(page)
            elif admit(page, branch) or seen[page]:
                held[page] = None
        seen.update(req)
        while len(held) > cap:
            held.popitem(last=False)
    return hits / total


def report(path: Path, caps: list[int], branch_reads: int) -> None:
    requests = read_trace(path).requests
    uses: Counter[int] = Counter(p for req in requests for p in req)
    born = births(requests)
    once = sum(1 for n in uses.values() if n == 1)
    twice = sum(1 for n in uses.values() if n >= 2)
    thrice = sum(1 for n in uses.values() if n >= 3)
    never = once / len(uses)
    print(
        f"{path.name}: {len(requests):,} requests, {len(uses):,} pages, "
        f"{never:.1%} never read again"
    )
    print(f"P(read a 2nd time) {twice / len(uses):.3f}, P(3rd | 2nd) {thrice / max(twice, 1):.3f}")
    for title, key in (
        ("accesses of the page it branches from", lambda b: b.branch_reads),
        ("pages of its request's prefix stored before it", lambda b: b.prefix_hit),
    ):
        print(f"\nP(read again) by {title}:")
        for name, n, p in reuse_by(born, uses, key):
            print(f"  {name:>9}  {n:>8,} pages  {p:.3f}")
    lost = sum(1 for p, b in born.items() if 0 < b.branch_reads <= branch_reads and uses[p] > 1)
    rule_head = f"LRU, branch reads > {branch_reads}"
    print(f"\n| cap | LRU | LRU, oracle admission | {rule_head} | reused pages refused |")
    print("| --- | --- | --- | --- | --- |")
    for d in caps:
        cap = len(uses) // d
        plain = lru(requests, cap, lambda page, branch: True)
        oracle = lru(requests, cap, lambda page, branch: uses[page] > 1)
        rule = lru(requests, cap, lambda page, branch: not 0 < branch <= branch_reads)
        print(f"| W/{d} | {plain:.4f} | {oracle:.4f} | {rule:.4f} | {lost:,} of {twice:,} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--caps", default="20,10", help="divisors of the trace's pages (W/d)")
    ap.add_argument("--branch-reads", type=int, default=2)
    args = ap.parse_args()
    try:
        report(args.trace, [int(c) for c in args.caps.split(",")], args.branch_reads)
    except (OSError, TraceError) as e:
        sys.exit(f"trace_reuse: {e}")


if __name__ == "__main__":
    main()
