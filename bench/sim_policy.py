"""Eviction policy simulator (issue #13, item 5).

A generated multi-session agent trace (Zipf session popularity, a shared system prefix, chat
histories that grow by a few pages a turn and sometimes reset, a server restart halfway) served
as SGLang serves it: each request looks its page chain up, hits the longest *contiguous* prefix
on disk, reads it, and writes the rest through (a page already on disk is skipped, as
`HiCacheFile.set` does). Before each page write, if the disk would go over the cap, the policy
evicts down to 0.9 x cap (SGLang's `LRUFileEvictor.reserve` with `eviction_ratio` 0.9). Pages
are all one size; W = pages written with no cap.

Policies:

* `lru`: page LRU by last access (SGLang's evictor while it runs; no restart);
* `lru-mtime`: the same, but at the restart the order is rebuilt from first-write time (SGLang
  seeds its LRU from mtime; reads and skipped re-writes never touch mtime);
* `cachemgr`: cachemgr's REAL chain model and order (`cachemgr.gc.chains`, `cachemgr.gc.value`)
  fed the page events its index would see, at two request rates (its clock is the event
  sequence, so both give the same result). Eviction is immediate, as the daemon's continuous
  eviction; the model survives the restart whole, as after a clean stop (the model file keeps
  the memory of evicted chains and the adaptive order's state);
* `cachemgr, perfect miniatures` (`--shadowed`): the same, its order chosen by full-size
  shadow caches, one per order, in place of the miniatures: the adaptive choice's ceiling;
* oracles (`Oracle`): tails first as cachemgr, told what it cannot see;
* `clairvoyant`: evict the page whose next lookup is farthest away (Belady);
* `no cap`.

Trace shapes (`--shape`, one generator, different parameters): `default`, the trace of the
earlier tables (500 sessions, Zipf 0.8, 32-page prefix, 2-8 pages a turn, reset p 0.05), and
`pressured`, calibrated to issue #13's figures (no cap ~0.96, LRU ~0.86 at W/3, clairvoyant
~0.93 / ~0.96): fewer, flatter-popularity sessions with longer conversations.

    .venv/bin/python bench/sim_policy.py [--shape NAME --sessions N --requests M --seed S]
    .venv/bin/python bench/sim_policy.py --trace bench/traces/conversation_trace.jsonl.gz
        # a recorded trace (bench/sim_trace.py: Mooncake / Bailian JSON lines, .gz or plain);
        # --half 1|2: only its first or second half of the requests
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from math import inf
from pathlib import Path
from typing import Any

from sim_peers import Arc, Policy, S3Fifo
from sim_trace import Recorded, read_trace

from cachemgr.gc.adapt import ORDERS, switched
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.minisim import WINDOW
from cachemgr.gc.returns import END
from cachemgr.gc.value import cap_order

EVICTION_RATIO = 0.9  # SGLang's default eviction_ratio (and the low watermark)
RATES = (0.1, 100.0)
ORACLES = ("rate", "ended", "rate+ended")  # simulated requests per second for the cachemgr policy


@dataclass(frozen=True)
class Shape:
    """make_trace's parameters for one kind of workload: sessions and requests of the full
    trace and of the smaller one bench_replay.py paces at ~2 req/s, and the generator's knobs."""

    sessions: int
    requests: int
    paced_sessions: int
    paced_requests: int
    knobs: dict[str, Any]


SHAPES = {
    "default": Shape(500, 4000, 120, 1000, {}),
    # Issue #13's trace: no cap ~0.96, LRU ~0.86 (W/3), clairvoyant ~0.93 (W/3) / ~0.96 (W/2).
    "pressured": Shape(
        150, 4000, 40, 1000, {"zipf": 0.6, "grow": (2, 6), "reset_p": 0.02, "sys_pages": 48}
    ),
}


@dataclass(frozen=True)
class Trace:
    parent: list[int]  # parent page of each page (-1: the first page of the system prefix)
    requests: list[tuple[int, ...]]  # the page chain each request looks up
    restart_at: int  # index of the first request after the server restart
    weight: list[float]  # each page's session's popularity (inf: the system prefix); oracles
    looked_up: int = 0  # pages the requests look up, if not all of `parent` (`half`)

    @property
    def pages(self) -> int:
        return self.looked_up or len(self.parent)


def make_trace(
    sessions: int,
    requests: int,
    seed: int,
    *,
    sys_pages: int = 32,
    zipf: float = 0.8,
    grow: tuple[int, int] = (2, 8),
    reset_p: float = 0.05,
    max_hist: int = 256,
) -> Trace:
    """A seeded agent trace; page ids grow along every chain (a parent's id < its child's)."""
    rng = random.Random(seed)
    parent: list[int] = []

    weight: list[float] = []

    def new_page(par: int, w: float = float("inf")) -> int:
        parent.append(par)
        weight.append(w)
        return len(parent) - 1

    prefix: list[int] = []
    for _ in range(sys_pages):
        prefix.append(new_page(prefix[-1] if prefix else -1))
    weights = [1.0 / (rank + 1) ** zipf for rank in range(sessions)]
    order = list(range(sessions))
    rng.shuffle(order)  # popularity rank is not session number
    hist: list[list[int]] = [[] for _ in range(sessions)]
    chains: list[tuple[int, ...]] = []
    for rank in rng.choices(range(sessions), weights, k=requests):
        h = hist[order[rank]]
        if h and (len(h) >= max_hist or rng.random() < reset_p):
            h.clear()  # a new conversation: a new chain after the system prompt
        tail = h[-1] if h else prefix[-1]
        for _ in range(rng.randint(*grow)):
            tail = new_page(tail, weights[rank])
            h.append(tail)
        chains.append((*prefix, *h))
    return Trace(parent, chains, requests // 2, weight)


class Lru(Policy):
    name = "lru"

    def __init__(self) -> None:
        self.lru: OrderedDict[int, None] = OrderedDict()

    def read(self, page: int, i: int) -> None:
        self.lru.move_to_end(page)

    skip = read  # `set` of a page that exists touches the evictor

    def write(self, page: int, i: int) -> None:
        self.lru[page] = None

    def victims(self, n: int, i: int, disk: set[int]) -> list[int]:
        return [self.lru.popitem(last=False)[0] for _ in range(n)]


class LruMtime(Lru):
    name = "lru-mtime"

    def __init__(self) -> None:
        super().__init__()
        self.mtime: dict[int, int] = {}

    def write(self, page: int, i: int) -> None:
        super().write(page, i)
        self.mtime[page] = i

    def restart(self, i: int) -> None:
        self.lru = OrderedDict((p, None) for p in sorted(self.lru, key=self.mtime.__getitem__))


class Cachemgr(Policy):
    """cachemgr's real model and order (cachemgr.gc.chains, cachemgr.gc.value), fed the events
    its index would see: one read per hit, one write per stored page, nothing for a page `set`
    skips (it only checks that the file exists). Its clock is the event sequence: the rate
    only moves the wall-clock times, which min_age (0 here) alone reads."""

    def __init__(self, rate: float, order: str | None = None) -> None:
        self.name = f"cachemgr @{rate:g}/s" + (f", {order} only" if order else "")
        self.rate = rate
        self.model = ChainModel()
        # One of cachemgr.gc.adapt.ORDERS followed throughout (None: the adaptive choice).
        self.model.adapt.fixed = None if order is None else ORDERS.index(order)
        self.seq = 0
        self.request = (-1, 0)  # the request being served, and the sequence before it
        self.evicted: list[int] = []  # every victim, in order (for tests)

    def _event(self, page: int, i: int, observe: Callable[..., object]) -> None:
        if i != self.request[0]:
            self.request = (i, self.seq)
        self.seq += 1
        observe("ns", _name(page), KEY_LEN, seq=self.seq, at=i / self.rate)

    def read(self, page: int, i: int) -> None:
        self._event(page, i, self.model.observe_read)

    def write(self, page: int, i: int) -> None:
        self._event(page, i, self.model.observe_write)

    def victims(self, n: int, i: int, disk: set[int]) -> list[int]:
        # In flight, as in the daemon: the pages of the request being served (it may write
        # more behind them). The same accesses at any rate: its pages are all "now".
        self.model.in_flight = self.seq - self.request[1] if i == self.request[0] else 0
        out: list[int] = []
        chosen: set[int] = set()
        for v, _ in cap_order(self.model, before=inf, now=i / self.rate):
            p = int(v.key, 16)
            if p not in chosen:  # (the second pass, past the protections, repeats the first)
                chosen.add(p)
                out.append(p)
            if len(out) == n:
                break
        self.model.remove("ns", ((_name(p), KEY_LEN) for p in out))
        self.evicted += out
        return out


class Shadowed(Policy):
    """cachemgr's real order, chosen as the adaptive choice chooses (cachemgr.gc.adapt) but by
    perfect miniatures: a full-size cache per order, each serving every request itself with
    that order alone, scored by its hits decayed over WINDOW caps' worth of page lookups. What
    it scores is the choice's ceiling: where it is behind an order followed alone, switching
    costs that (the cache an order left is not the one the next would have kept), not the
    miniatures' sample or shape."""

    def __init__(self, trace: Trace, cap: int) -> None:
        self.name = "cachemgr, perfect miniatures"
        self.trace, self.cap = trace, cap
        self.main = Cachemgr(max(RATES), ORDERS[0])
        self.shadows = [(Cachemgr(max(RATES), o), set[int]()) for o in ORDERS]
        self.scores = [0.0] * len(ORDERS)
        self.decay = 1.0 - 1.0 / (WINDOW * cap)
        self.follow, self.served = 0, -1

    def _shadows_serve(self, i: int) -> None:
        """The shadows serve request `i` (before the real cache does: they are independent)."""
        while self.served < i:
            self.served += 1
            chain = self.trace.requests[self.served]
            decay = self.decay ** len(chain)
            for o, (policy, disk) in enumerate(self.shadows):
                hits, _, _ = lookup(chain, self.served, policy, disk, self.cap)
                self.scores[o] = self.scores[o] * decay + hits

    def read(self, page: int, i: int) -> None:
        self._shadows_serve(i)
        self.main.read(page, i)

    def write(self, page: int, i: int) -> None:
        self._shadows_serve(i)
        self.main.write(page, i)

    def victims(self, n: int, i: int, disk: set[int]) -> list[int]:
        self._shadows_serve(i)
        self.follow = switched(self.scores, self.follow)
        self.main.model.adapt.fixed = self.follow
        return self.main.victims(n, i, disk)


KEY_LEN = 8


def _name(page: int) -> str:
    return f"{page:08x}_model_0_1.bin"


class Clairvoyant(Policy):
    """Belady: evict the page whose next lookup comes last (never again: first)."""

    name = "clairvoyant"

    def __init__(self, trace: Trace) -> None:
        self.uses: dict[int, list[int]] = {}
        for i, chain in enumerate(trace.requests):
            for p in chain:
                self.uses.setdefault(p, []).append(i)
        self.pos: dict[int, int] = {}  # page -> index into uses of its current lookup
        self.nxt: dict[int, float] = {}
        self.heap: list[tuple[float, int]] = []

    def _seen(self, page: int, i: int) -> None:
        uses = self.uses[page]
        k = self.pos.get(page, -1) + 1
        while uses[k] < i:
            k += 1
        self.pos[page] = k
        nxt = float(uses[k + 1]) if k + 1 < len(uses) else float("inf")
        self.nxt[page] = nxt
        heapq.heappush(self.heap, (-nxt, page))

    read = write = skip = _seen

    def victims(self, n: int, i: int, disk: set[int]) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            neg, p = heapq.heappop(self.heap)
            if p in disk and p not in out and self.nxt.get(p) == -neg:
                out.append(p)
        return out


class Oracle(Policy):
    """Bounds for an online policy, tails first as cachemgr, told what it cannot see: each
    page's session's true popularity (`rate`: value = popularity x P(alive) after its silence,
    the estimate cachemgr makes from what it sees), which pages will never be looked up again
    (`ended`: those first, then least recently used), or both (`rate+ended`: ended chains
    first, then the least popular). Not cachemgr's code: what it could do knowing more."""

    def __init__(self, trace: Trace, knows: str) -> None:
        self.name = f"oracle: {knows}"
        self.trace, self.knows = trace, knows
        self.last: dict[int, int] = {}
        self.final = {p: i for i, chain in enumerate(trace.requests) for p in chain}
        total = sum(set(trace.weight) - {float("inf")})
        self.per_request = {w: w / total for w in set(trace.weight)}  # P(a request is it)

    def read(self, page: int, i: int) -> None:
        self.last[page] = i

    write = read

    def _key(self, page: int, i: int) -> tuple[float, int]:
        last = self.last[page]
        ended = self.final[page] <= i
        rate = self.per_request[self.trace.weight[page]]
        if self.knows == "ended":
            return (0.0 if ended else 1.0, last)
        if self.knows == "rate+ended":
            return (0.0 if ended else rate, last)
        silence = min(rate * (i - last), 700.0)
        return (rate / (1 + END / (1 - END) * math.exp(silence)), last)

    def victims(self, n: int, i: int, disk: set[int]) -> list[int]:
        parent = self.trace.parent
        kids: dict[int, int] = {}
        for p in disk:
            if parent[p] in disk:
                kids[parent[p]] = kids.get(parent[p], 0) + 1
        heap = [(self._key(p, i), p) for p in disk if p not in kids]
        heapq.heapify(heap)
        out: list[int] = []
        while len(out) < n:
            _, p = heapq.heappop(heap)
            out.append(p)
            up = parent[p]
            if up in kids:
                kids[up] -= 1
                if not kids[up]:
                    heapq.heappush(heap, (self._key(up, i), up))
        for p in out:
            del self.last[p]
        return out


@dataclass(frozen=True)
class Result:
    policy: str
    cap: int | None
    hits: int
    lookups: int
    unusable_end: int
    unusable_avg: float
    max_on_disk: int
    evicted: int

    @property
    def ratio(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


def unusable(disk: set[int], parent: Sequence[int]) -> int:
    """Pages on disk behind a missing page of their chain (ids grow along a chain)."""
    ok: set[int] = set()
    for p in sorted(disk):
        par = parent[p]
        if par < 0 or par in ok:
            ok.add(p)
    return len(disk) - len(ok)


def lookup(
    chain: Sequence[int], i: int, policy: Policy | None, disk: set[int], cap: int | None
) -> tuple[int, int, int]:
    """Request `i` served (its chain looked up, the hits read, the rest written, evicting
    first to EVICTION_RATIO of the cap when a write would pass it): (hits, pages evicted,
    most pages on disk)."""
    n = 0
    while n < len(chain) and chain[n] in disk:
        n += 1
    for p in chain[:n]:
        if policy is not None:
            policy.read(p, i)
    evicted = most = 0
    for p in chain[n:]:
        if p in disk:  # behind a missing page: `set` skips it
            if policy is not None:
                policy.skip(p, i)
            continue
        if cap is not None and policy is not None and len(disk) + 1 > cap:
            victims = policy.victims(len(disk) - (int(cap * EVICTION_RATIO) - 1), i, disk)
            if not disk.issuperset(victims) or len(set(victims)) != len(victims):
                raise AssertionError(f"{policy.name} evicted pages not on disk")
            disk.difference_update(victims)
            evicted += len(victims)
            if len(disk) + 1 > cap:
                raise AssertionError(f"{policy.name} left {len(disk)} pages, cap {cap}")
        disk.add(p)
        most = max(most, len(disk))
        if policy is not None:
            policy.write(p, i)
    return n, evicted, most


def serve(trace: Trace, policy: Policy | None, cap: int | None, samples: int = 100) -> Result:
    """Replay the trace against one policy under one cap (None: no cap)."""
    disk: set[int] = set()
    hits = lookups = max_on_disk = evicted = 0
    every = max(1, len(trace.requests) // samples)
    unusable_sum = unusable_n = 0
    for i, chain in enumerate(trace.requests):
        if i == trace.restart_at and policy is not None:
            policy.restart(i)
        lookups += len(chain)
        n, gone, most = lookup(chain, i, policy, disk, cap)
        hits += n
        evicted += gone
        max_on_disk = max(max_on_disk, most)
        if i % every == every - 1:
            unusable_sum += unusable(disk, trace.parent)
            unusable_n += 1
    name = policy.name if policy is not None else "no cap"
    avg = unusable_sum / unusable_n if unusable_n else 0.0
    return Result(name, cap, hits, lookups, unusable(disk, trace.parent), avg, max_on_disk, evicted)


def policies(
    trace: Trace, rates: Iterable[float] = RATES, orders: Iterable[str] = ()
) -> list[Callable[[], Policy]]:
    makers: list[Callable[[], Policy]] = [Lru, LruMtime]
    makers += [lambda r=r: Cachemgr(r) for r in rates]
    makers += [lambda o=o: Cachemgr(max(RATES), o) for o in orders]
    makers += [lambda k=k: Oracle(trace, k) for k in ORACLES]
    makers.append(lambda: Clairvoyant(trace))
    return makers


def run(
    trace: Trace,
    rates: Iterable[float] = RATES,
    orders: Iterable[str] = (),
    shadowed: bool = False,
) -> list[Result]:
    """No cap, then every policy at W/3 and W/2 (`orders`: also cachemgr following each of
    these orders alone; `shadowed`: also its choice by perfect miniatures)."""
    nocap = serve(trace, None, None)
    out = [nocap]
    for div in (3, 2):
        cap = trace.pages // div
        out += [serve(trace, make(), cap) for make in policies(trace, rates, orders)]
        if shadowed:
            out.append(serve(trace, Shadowed(trace, cap), cap))
    return out


PEERS = ("lru", "s3-fifo", "arc")  # the online peers cachemgr is to be never behind (#21)


def table(trace: Trace, results: list[Result]) -> str:
    w = trace.pages
    lines = [
        "| policy | cap | page hit ratio | of LRU→clairvoyant gap | cachemgr - best peer |"
        " unusable at end | unusable avg | max on disk / cap |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = {r.cap: r.ratio for r in results if r.policy == "lru"}
    best = {r.cap: r.ratio for r in results if r.policy == "clairvoyant"}
    peer: dict[int | None, float] = {}  # the best online peer's ratio at each cap
    for r in results:
        if r.policy in PEERS:
            peer[r.cap] = max(peer.get(r.cap, 0.0), r.ratio)
    for r in results:
        cap = "none" if r.cap is None else f"W/{round(w / r.cap)} ({r.cap})"
        gap = (
            ""
            if r.cap is None or best[r.cap] == base[r.cap]
            else (f"{(r.ratio - base[r.cap]) / (best[r.cap] - base[r.cap]):+.0%}")
        )
        fill = "" if r.cap is None else f"{r.max_on_disk / r.cap:.2f}"
        ours = r.policy.startswith("cachemgr") and r.cap in peer
        ahead = f"{r.ratio - peer[r.cap]:+.4f}" if ours else ""
        lines.append(
            f"| {r.policy} | {cap} | {r.ratio:.3f} | {gap} | {ahead} | {r.unusable_end} |"
            f" {r.unusable_avg:.0f} | {fill} |"
        )
    return "\n".join(lines)


def from_recorded(rec: Recorded) -> Trace:
    """A recorded trace as the simulator's: no restart (none is recorded), no popularity
    (the oracles that need it are not run)."""
    return Trace(rec.parent, rec.requests, len(rec.requests), [1.0] * len(rec.parent))


def half(trace: Trace, which: int) -> Trace:
    """The first or second half of a recorded trace's requests, replayed alone (W: the pages
    they look up), so that a choice tuned on one half is checked on the other."""
    n = len(trace.requests) // 2
    requests = trace.requests[:n] if which == 1 else trace.requests[n:]
    looked_up = {p for chain in requests for p in chain}
    return Trace(trace.parent, requests, len(requests), trace.weight, len(looked_up))


def recorded_peers(
    trace: Trace,
    cap: int,
    rates: Iterable[float],
    orders: Iterable[str] = (),
    shadowed: bool = False,
) -> list[Policy]:
    """LRU, S3-FIFO, ARC, cachemgr's real policy (and following each of `orders` alone, and
    choosing by perfect miniatures if `shadowed`) and the clairvoyant bound, for one cap."""
    peers: list[Policy] = [Lru(), S3Fifo(cap), Arc(cap), *(Cachemgr(r) for r in rates)]
    peers += [Cachemgr(max(rates), o) for o in orders]
    peers += [Shadowed(trace, cap)] if shadowed else []
    return [*peers, Clairvoyant(trace)]


def run_recorded(
    trace: Trace,
    divisors: Iterable[int],
    rates: Iterable[float],
    orders: Iterable[str] = (),
    shadowed: bool = False,
) -> list[Result]:
    """No cap, then the recorded-trace peers at each W/d."""
    out = [serve(trace, None, None)]
    for div in divisors:
        cap = trace.pages // div
        peers = recorded_peers(trace, cap, rates, orders, shadowed)
        out += [serve(trace, p, cap) for p in peers]
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="default")
    ap.add_argument("--sessions", type=int, help="default: the shape's")
    ap.add_argument("--requests", type=int, help="default: the shape's")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--trace", type=Path, help="a recorded trace (Mooncake / Bailian JSON lines)")
    ap.add_argument("--caps", default="20,10,5,3,2", help="with --trace: divisors d of W/d")
    ap.add_argument("--rates", default="100", help="with --trace: cachemgr's request rates")
    ap.add_argument(
        "--half",
        type=int,
        choices=(1, 2),
        help="with --trace: replay only its first or second half",
    )
    ap.add_argument(
        "--orders",
        default="",
        help=f"also cachemgr following each of these orders alone ({','.join(ORDERS)})",
    )
    ap.add_argument(
        "--shadowed",
        action="store_true",
        help="also cachemgr choosing its order by perfect miniatures (full-size shadow caches,"
        " one per order): the choice's ceiling",
    )
    args = ap.parse_args(argv)
    orders = [o for o in args.orders.split(",") if o]
    if set(orders) - set(ORDERS):
        raise SystemExit(f"sim_policy: --orders takes {', '.join(ORDERS)}")
    t0 = time.monotonic()
    if args.trace is not None:
        try:
            rec = read_trace(args.trace)
            caps = [int(c) for c in args.caps.split(",")]
            rates = [float(r) for r in args.rates.split(",")]
        except (OSError, ValueError) as e:
            raise SystemExit(f"sim_policy: {e}") from None
        trace = from_recorded(rec) if args.half is None else half(from_recorded(rec), args.half)
        extra = f", {rec.conversations} conversations" if rec.conversations else ""
        extra += f", types {dict(rec.types)}" if rec.types else ""
        print(
            f"trace {args.trace.name}: {len(trace.requests)} requests{extra};"
            f" W = {trace.pages} pages, {sum(len(c) for c in trace.requests)} page lookups;"
            f" {rec.relinked} block ids seen after another parent; no restart"
        )
        print(table(trace, run_recorded(trace, caps, rates, orders, args.shadowed)))
        print(f"({time.monotonic() - t0:.1f}s)")
        return
    shape = SHAPES[args.shape]
    sessions, requests = args.sessions or shape.sessions, args.requests or shape.requests
    trace = make_trace(sessions, requests, args.seed, **shape.knobs)
    results = run(trace, orders=orders, shadowed=args.shadowed)
    lookups = sum(len(c) for c in trace.requests)
    print(
        f"trace {args.shape!r}: {sessions} sessions, {requests} requests, seed {args.seed};"
        f" W = {trace.pages} pages, {lookups} page lookups; restart before request"
        f" {trace.restart_at}"
    )
    print(table(trace, results))
    print(f"({time.monotonic() - t0:.1f}s)")


if __name__ == "__main__":
    main()
