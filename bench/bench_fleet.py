"""Fleet mode's long must-shows (issue #24), on the test bed: a real etcd on loopback ports,
nodes that are bindfs mounts of one backing dir, `cachemgr serve` processes. CI runs the same
scenarios for 10 s (tests/test_fleet.py, tests/test_fleet_load.py); these run the issue's 60 s.

  outage  two nodes, etcd stopped for SECONDS with twice the cap stored meanwhile: no node
          leads or deletes, every node serves /metrics and /v1/status each second; then etcd
          comes back: how long until one node leads and GC has the cap back.
  load    three followers (real AccessShippers) each shipping 5,000 page reads a second to the
          leader for SECONDS: /metrics latency on the leader under that load beside the same
          leader idle as long (the peer: what the box gives a scrape without fleet load), both
          scraped by a process of their own; every access merged, none dropped, and the
          leader's RSS each second.

Usage: python bench/bench_fleet.py [outage|load|all] [SECONDS] (default: all 60). Needs root,
/dev/fuse, etcd and bindfs (scripts/test-deps.sh).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from cachemgr.fleet.accesses import AccessShipper
from tests.daemon_helpers import NS_A, page_name, store_page
from tests.fleet_bed import Etcd, page_bytes_in
from tests.polling import wait_for
from tests.test_fleet_load import PAGES, RATE, feed, rss_kib, shipping_followers
from tests.test_fleet_procs import TTL, Node, bed, nodes

PAGE = 64 * 1024
CAP_PAGES = 10


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def percentiles(samples: list[float]) -> str:
    s = sorted(samples)
    p99 = s[max(0, int(len(s) * 0.99) - 1)]
    return f"p50 {ms(statistics.median(s))}, p99 {ms(p99)}, max {ms(s[-1])} ({len(s)} requests)"


def leaders(live: list[Node]) -> list[str]:
    return [n.name for n in live if n.leading()]


def outage(tmp: Path, seconds: float) -> None:
    env = {"CACHEMGR_GC_MAX_BYTES": str(CAP_PAGES * PAGE), "CACHEMGR_GC_INTERVAL": "1s"}
    with bed(tmp, 2) as (etcd, mounts), nodes(tmp, etcd, mounts, env) as fleet:
        backing = tmp / "backing" / "ns" / NS_A
        wait_for(lambda: leaders(fleet), lambda ls: len(ls) == 1, timeout=30)
        stopped = time.monotonic()
        etcd.stop()
        wait_for(lambda: leaders(fleet), lambda ls: ls == [], timeout=3 * TTL, what="no leader")
        print(f"etcd stopped; no node leads after {time.monotonic() - stopped:.1f} s")
        at = time.time()
        for i in range(2 * CAP_PAGES):  # twice the cap, while nobody may delete
            store_page(mounts[0] / "ns" / NS_A, page_name(i), PAGE)
        stored = page_bytes_in(backing)
        latencies, failures, led = serve_while_down(fleet, backing, stored, stopped + seconds)
        print(f"etcd down {time.monotonic() - stopped:.1f} s: every node asked once a second")
        print(f"  /metrics and /v1/status: {percentiles(latencies)}; failed: {failures}")
        deleted = stored - page_bytes_in(backing)
        evicted = sum(n.evictions_since(at) for n in fleet)
        print(f"  seconds with a leader: {led}; bytes deleted: {deleted}; evictions: {evicted}")
        back_after(etcd, fleet, backing)


def serve_while_down(
    fleet: list[Node], backing: Path, stored: int, until: float
) -> tuple[list[float], int, int]:
    """Ask each node's /metrics and /v1/status every second until `until`."""
    latencies: list[float] = []
    failures = led = 0
    with httpx.Client(timeout=10) as http:
        while time.monotonic() < until:
            for n in fleet:
                for path in ("/metrics", "/v1/status"):
                    t0 = time.perf_counter()
                    try:
                        ok = http.get(n.url + path).status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    latencies.append(time.perf_counter() - t0)
                    failures += not ok
            led += bool(leaders(fleet))
            assert page_bytes_in(backing) == stored, "a node deleted without a lease"
            time.sleep(1)
    return latencies, failures, led


def back_after(etcd: Etcd, fleet: list[Node], backing: Path) -> None:
    started = time.monotonic()
    etcd.start()
    print(f"etcd back (serving after {time.monotonic() - started:.1f} s)")
    found = wait_for(lambda: leaders(fleet), lambda ls: len(ls) == 1, timeout=60)
    print(f"  {found[0]} leads {time.monotonic() - started:.1f} s after the restart")
    cap = CAP_PAGES * PAGE
    wait_for(lambda: page_bytes_in(backing), lambda b: b <= cap, timeout=120, what="GC")
    print(f"  cap kept again {time.monotonic() - started:.1f} s after the restart")


def load(tmp: Path, seconds: float) -> None:
    with bed(tmp, 1) as (etcd, mounts), nodes(tmp, etcd, mounts) as (leader,):
        for i in range(PAGES):
            store_page(mounts[0] / "ns" / NS_A, page_name(i), 64)
        idle = latencies(scraper(leader, seconds))
        print(f"leader idle, {seconds:.0f} s: /metrics {percentiles(idle)}")
        with shipping_followers(etcd) as shippers:
            under_load(leader, shippers, seconds)


SCRAPER = """
import json, sys, time, httpx
url, seconds = sys.argv[1], float(sys.argv[2])
out, stop = [], time.monotonic() + seconds
with httpx.Client(base_url=url, timeout=10) as http:
    while time.monotonic() < stop:
        t0 = time.perf_counter()
        assert http.get("/metrics").status_code == 200
        out.append(time.perf_counter() - t0)
        time.sleep(0.1)
print(json.dumps(out))
"""


def scraper(leader: Node, seconds: float) -> subprocess.Popen[str]:
    """/metrics scraped each 0.1 s for `seconds` by a process of its own, as Prometheus
    would: the shippers' threads here must not delay the client's side of the timing."""
    argv = [sys.executable, "-c", SCRAPER, leader.url, str(seconds)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def latencies(proc: subprocess.Popen[str]) -> list[float]:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0
    found: list[float] = json.loads(out)
    return found


def under_load(leader: Node, shippers: list[AccessShipper], seconds: float) -> None:
    rss: list[int] = [rss_kib(leader.proc.pid)]
    stop = time.monotonic() + seconds
    sent = [0] * len(shippers)

    def run(i: int) -> None:
        sent[i] = feed(shippers[i], stop)

    feeders = [threading.Thread(target=run, args=(i,)) for i in range(len(shippers))]
    for t in feeders:
        t.start()
    scraping = scraper(leader, seconds)
    while time.monotonic() < stop:
        time.sleep(1)
        rss.append(rss_kib(leader.proc.pid))
    busy = latencies(scraping)
    for t in feeders:
        t.join()
    want = {f"follower{i}": n for i, n in enumerate(sent)}

    def received() -> dict[str, int]:
        return {n["node"]: n["accesses"] for n in leader.fleet()["nodes"]}

    t0 = time.monotonic()
    got = wait_for(received, lambda r: r == want, timeout=60, what="every access merged")
    print(f"{len(shippers)} followers x {RATE}/s for {seconds:.0f} s: sent {sum(sent):,}")
    print(f"  merged {sum(got.values()):,} ({time.monotonic() - t0:.1f} s after the last send)")
    print(f"  dropped by followers: {sum(sh.dropped for sh in shippers)}")
    print(f"  leader /metrics under load: {percentiles(busy)}")
    half = len(rss) // 2
    print(
        f"  leader RSS: {rss[0] / 1024:.0f} MiB before, {max(rss[:half]) / 1024:.0f} MiB peak "
        f"in the first half, {max(rss[half:]) / 1024:.0f} MiB peak in the second, "
        f"{rss[-1] / 1024:.0f} MiB at the end"
    )


def main() -> None:
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
    runs = {"outage": outage, "load": load}
    for name, run in runs.items():
        if which in (name, "all"):
            with tempfile.TemporaryDirectory() as tmp:
                print(f"== {name} ({seconds:.0f} s)")
                run(Path(tmp), seconds)


if __name__ == "__main__":
    main()
