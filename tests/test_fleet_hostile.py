"""A broken or hostile follower posting to the leader's POST /v1/fleet/accesses: what it sends
is refused (problem+json 4xx) or ignored, never a crash, never a page counted twice. Real etcd,
a real leader daemon on a bindfs node."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from cachemgr.fleet.accesses import MAX_NODES, SUMMARY_PATH
from tests.daemon_helpers import NS_A, RunningDaemon, page_name, read_page, store_page
from tests.polling import wait_for
from tests.test_fleet import fleet, gauge, indexed, leaders

pytestmark = pytest.mark.fleet
PAGES = 20


@contextmanager
def leader(tmp: Path, **kw: object) -> Iterator[RunningDaemon]:
    """One node leading, with PAGES pages of NS_A indexed."""
    with fleet(tmp, 1, **{"gc_interval": "1h", **kw}) as (_, mounts, (daemon,)):
        for i in range(PAGES):
            store_page(mounts[0] / "ns" / NS_A, page_name(i))
        wait_for(lambda: leaders([daemon]), lambda ls: ls == [0], timeout=20)
        wait_for(lambda: indexed(daemon), lambda n: n == PAGES, timeout=20)
        yield daemon


def summary(accesses: list[list[str]], **kw: Any) -> dict[str, Any]:
    return {
        "node": "nodeB",
        "session": uuid.uuid4().hex,
        "first": 1,
        "dropped": 0,
        "accesses": accesses,
        **kw,
    }


def reads(daemon: RunningDaemon) -> int:
    return int(daemon.namespaces()[NS_A]["page_reads"])


def applied(daemon: RunningDaemon, before: int) -> None:
    """Wait until a read posted after the hostile batch is applied: the batch was too."""
    r = daemon.post(SUMMARY_PATH, json=summary([["r", NS_A, page_name(0)]]))
    assert r.json() == {"accepted": 1}
    wait_for(lambda: reads(daemon), lambda n: n == before + 1, timeout=20, what="the read")


BAD_NAMES = [
    "x\x00/" + page_name(1),  # NUL in a dir: the index's stat raised, its writer died
    "./" + page_name(1),  # the same file as page 1, counted a second time
    "/tmp/" + page_name(1),
    "sub/" + page_name(1),
    "../" + NS_A + "/" + page_name(1),
]


def test_names_no_watcher_makes_are_ignored_not_counted_and_not_fatal(tmp_path: Path) -> None:
    with leader(tmp_path) as daemon:
        before = reads(daemon)
        for name in BAD_NAMES:
            for kind in ("w", "r"):
                r = daemon.post(SUMMARY_PATH, json=summary([[kind, NS_A, name]]))
                assert r.status_code == 200, r.text
                assert r.json() == {"accepted": 0}, name
        applied(daemon, before)
        assert gauge(daemon, 'cachemgr_worker_up\\{worker="index"\\}') == 1
        assert daemon.get("/readyz").status_code == 200
        assert indexed(daemon) == PAGES
        assert daemon.namespaces()[NS_A]["bytes"] == PAGES * 1024


def test_a_summary_without_the_token_is_a_401_problem(tmp_path: Path) -> None:
    with leader(tmp_path, token="s3cret") as daemon:
        body = summary([["r", NS_A, page_name(0)]])
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = daemon.post(SUMMARY_PATH, json=body, headers=headers)
            assert r.status_code == 401
            assert r.headers["content-type"] == "application/problem+json"
        good = {"Authorization": "Bearer s3cret"}
        r = daemon.post(SUMMARY_PATH, json=body, headers=good)
        assert r.json() == {"accepted": 1}
        r = daemon.post(SUMMARY_PATH, json=body, headers=good)
        assert r.json() == {"accepted": 0}  # sent again (its answer lost): not counted twice


def test_a_batch_repeating_dir_changes_rescans_the_namespace_at_most_twice(tmp_path: Path) -> None:
    with leader(tmp_path) as daemon:
        before, scans = reads(daemon), daemon.status()["index"]["scans"]
        changes = [["a", NS_A, ""]] * 2500 + [["g", NS_A, ""], ["a", NS_A, ""]] * 1250
        r = daemon.post(SUMMARY_PATH, json=summary(changes))
        assert r.status_code == 200
        applied(daemon, before)
        assert daemon.status()["index"]["scans"] - scans <= 2  # an "a", a "g" of a dir here
        assert indexed(daemon) == PAGES


def test_a_namespace_said_gone_that_is_still_there_stays_watched(tmp_path: Path) -> None:
    with leader(tmp_path) as daemon:
        r = daemon.post(SUMMARY_PATH, json=summary([["g", NS_A, ""]]))
        assert r.json() == {"accepted": 1}
        applied(daemon, reads(daemon))
        # this node's own read and store there still count (its watch used to end for good)
        ns_dir = Path(daemon.daemon.settings.root) / "ns" / NS_A
        before = reads(daemon)
        read_page(ns_dir, page_name(3))
        store_page(ns_dir, page_name(PAGES))
        wait_for(lambda: reads(daemon), lambda n: n == before + 1, timeout=20, what="the read")
        wait_for(lambda: indexed(daemon), lambda n: n == PAGES + 1, timeout=20, what="the store")


def test_the_leaders_own_name_and_nodes_past_the_cap_are_409_problems(tmp_path: Path) -> None:
    with leader(tmp_path) as daemon:
        r = daemon.post(SUMMARY_PATH, json=summary([], node="node0"))  # the leader's name
        assert r.status_code == 409 and "own node name" in r.json()["detail"]
        assert r.headers["content-type"] == "application/problem+json"
        for i in range(MAX_NODES):  # a follower posting under ever new names
            r = daemon.post(SUMMARY_PATH, json=summary([], node=f"n{i}"))
            assert r.status_code == 200, (i, r.text)
        r = daemon.post(SUMMARY_PATH, json=summary([], node="one-more"))
        assert r.status_code == 409 and "nodes already" in r.json()["detail"]
        r = daemon.post(SUMMARY_PATH, json=summary([["r", NS_A, page_name(0)]], node="n7"))
        assert r.json() == {"accepted": 1}  # the nodes it knows still ship
        fleet = daemon.get("/v1/fleet").json()
        assert len(fleet["nodes"]) == MAX_NODES
        assert "node0" not in {n["node"] for n in fleet["nodes"]}


def test_stores_of_files_not_there_or_repeated_evict_no_real_page(tmp_path: Path) -> None:
    # Room for 30 pages, 20 stored: GC counts each store the index has not applied yet as a
    # page of the largest size, so 5,000 claimed stores used to evict all 20 real pages
    # (a batch_interval of 3 s: GC runs, woken by the stores, before the index applies them).
    with leader(tmp_path, gc_max_bytes=30 * 1024, gc_min_age="0s", batch_interval=3) as daemon:
        phantoms = [["w", NS_A, page_name(10_000 + i)] for i in range(2500)]
        repeats = [["w", NS_A, page_name(5)]] * 2500  # one real page, stored "again"
        r = daemon.post(SUMMARY_PATH, json=summary(phantoms + repeats))
        assert r.status_code == 200
        applied(daemon, reads(daemon))
        time.sleep(1)  # a GC the stores woke has run by now
        assert len(list((tmp_path / "backing" / "ns" / NS_A).glob("*.bin"))) == PAGES
        assert indexed(daemon) == PAGES
        assert r.json() == {"accepted": 1}
