"""Fleet mode with real parts: etcd on loopback ports, nodes that are bindfs mounts of one
backing dir (each node's inotify sees only its own accesses), real daemons on loopback ports.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from cachemgr.daemon.lifecycle import Daemon
from cachemgr.doctor.fleet import lint_fleet
from cachemgr.errors import ConfigError
from cachemgr.fleet.accesses import SILENT, AccessShipper
from cachemgr.fleet.coordinator import LeaderRecord
from cachemgr.fleet.elector import Elector
from cachemgr.fleet.etcd import EtcdCoordinator
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.settings import Settings, load_settings
from tests.daemon_helpers import (
    NS_A,
    RunningDaemon,
    page_name,
    read_page,
    register_namespace,
    running_daemon,
    store_page,
)
from tests.fleet_bed import Etcd, bindfs_nodes, need_binaries, page_bytes_in, running_etcd
from tests.nsfixtures import cli
from tests.polling import wait_for

pytestmark = pytest.mark.fleet
TTL, RENEW = 3.0, 0.5  # short leases: the tests wait for failovers


def node_settings(mount: Path, state: Path, etcd: Etcd, i: int, **kw: object) -> Settings:
    return load_settings(
        root=mount,
        state_dir=state,
        log_format="json",
        fleet_coordinator=etcd.coordinator,
        node_name=f"node{i}",
        fleet_lease_ttl=TTL,
        fleet_renew_interval=RENEW,
        **{"gc_interval": "1s", **kw},
    )


def gauge(daemon: RunningDaemon, name: str) -> float:
    text = daemon.get("/metrics").text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


@contextmanager
def fleet(
    tmp: Path, n: int, **kw: object
) -> Iterator[tuple[Etcd, list[Path], list[RunningDaemon]]]:
    """`n` daemons, one per bindfs node, led through one real etcd."""
    need_binaries()
    with ExitStack() as stack:
        etcd = stack.enter_context(running_etcd(tmp))
        mounts = stack.enter_context(bindfs_nodes(tmp / "backing", tmp / "mnt", n))
        create_root(Layout.at(mounts[0], tmp / "state0"))
        register_namespace(Layout.at(mounts[0], tmp / "state0"), NS_A)
        daemons = [
            stack.enter_context(running_daemon(node_settings(m, tmp / f"state{i}", etcd, i, **kw)))
            for i, m in enumerate(mounts)
        ]
        yield etcd, mounts, daemons


def leaders(daemons: list[RunningDaemon]) -> list[int]:
    return [i for i, d in enumerate(daemons) if gauge(d, "cachemgr_gc_leader") == 1]


def test_one_gc_leader_among_three_nodes(tmp_path: Path) -> None:
    with fleet(tmp_path, 3) as (_, _, daemons):
        found = wait_for(lambda: leaders(daemons), lambda ls: len(ls) == 1, timeout=20)
        views = [d.get("/v1/fleet").json() for d in daemons]
        assert {v["leader"] for v in views} == {f"node{found[0]}"}
        assert [v["leading"] for v in views] == [i == found[0] for i in range(3)]
        for _ in range(5):  # exactly one, sampled every second
            time.sleep(1)
            assert len(leaders(daemons)) == 1


def test_fleet_mode_refuses_a_state_dir_on_a_fuse_mount(tmp_path: Path) -> None:
    need_binaries()
    with running_etcd(tmp_path) as etcd, bindfs_nodes(tmp_path / "b", tmp_path / "m", 1) as (m,):
        settings = node_settings(m, m / ".cachemgr", etcd, 0)
        with pytest.raises(ConfigError, match=r"state dir .* is on fuse: .* node-local"):
            Daemon(settings.model_copy(update={"port": 0})).start()


def page_bytes(backing: Path) -> int:
    return page_bytes_in(backing / "ns" / NS_A)


def indexed(daemon: RunningDaemon) -> int:
    ns = daemon.namespaces().get(NS_A)
    return int(ns["pages"]) if ns else 0


def test_a_page_read_only_through_a_follower_outlives_colder_pages_the_leader_wrote(
    tmp_path: Path,
) -> None:
    size, cap = 64 * 1024, 24 * 64 * 1024  # 20 pages: under the high watermark
    with fleet(tmp_path, 2, gc_max_bytes=cap) as (_, mounts, daemons):
        (lead,) = wait_for(lambda: leaders(daemons), lambda ls: len(ls) == 1, timeout=20)
        follow = 1 - lead
        on_leader, on_follower = (m / "ns" / NS_A for m in (mounts[lead], mounts[follow]))
        for i in range(20):
            store_page(on_leader, page_name(i), size)
            time.sleep(0.02)  # past chains.BURST_GAP: 20 chains of one page, not one chain
        wait_for(lambda: indexed(daemons[lead]), lambda n: n == 20, timeout=20)
        hot = [page_name(i) for i in range(5)]  # the oldest pages: the first to go by age
        for _ in range(3):
            for name in hot:
                read_page(on_follower, name)
            time.sleep(0.3)

        def merged() -> int:
            nodes = daemons[lead].get("/v1/fleet").json()["nodes"]
            return sum(n["accesses"] for n in nodes if n["node"] == f"node{follow}")

        wait_for(merged, lambda n: n >= 15, timeout=20, what="the follower's reads merged")
        for i in range(20, 30):
            store_page(on_leader, page_name(i), size)
        backing = tmp_path / "backing"
        wait_for(lambda: page_bytes(backing), lambda b: b <= cap, timeout=30, what="GC")
        left = {p.name for p in (backing / "ns" / NS_A).glob("*.bin")}
        assert set(hot) <= left, sorted(set(hot) - left)
        assert len(left) < 30


def test_with_etcd_down_no_node_leads_the_api_serves_and_gc_resumes_after(tmp_path: Path) -> None:
    size, cap = 64 * 1024, 10 * 64 * 1024
    with fleet(tmp_path, 2, gc_max_bytes=cap) as (etcd, mounts, daemons):
        wait_for(lambda: leaders(daemons), lambda ls: len(ls) == 1, timeout=20)
        etcd.stop()
        wait_for(lambda: leaders(daemons), lambda ls: ls == [], timeout=3 * TTL, what="no leader")
        ns_dir = mounts[0] / "ns" / NS_A
        for i in range(20):  # twice the cap, while nobody may delete
            store_page(ns_dir, page_name(i), size)
        down_for = time.monotonic() + 10  # the 60 s, cut to fit the CI budget
        backing = tmp_path / "backing"
        while time.monotonic() < down_for:
            for d in daemons:
                assert d.get("/metrics").status_code == 200
                assert d.get("/v1/status").status_code == 200
                assert gauge(d, "cachemgr_fleet_coordinator_up") == 0
            assert page_bytes(backing) == 20 * size  # nothing deleted without a lease
            assert leaders(daemons) == []
            time.sleep(1)
        etcd.start()
        wait_for(lambda: leaders(daemons), lambda ls: len(ls) == 1, timeout=30)
        wait_for(lambda: page_bytes(backing), lambda b: b <= cap, timeout=60, what="GC again")


def test_cli_gc_on_a_follower_node_deletes_nothing_and_names_the_leader(tmp_path: Path) -> None:
    # A follower's daemon lets its node's gc.lock go: `cachemgr gc --yes` there took it and
    # evicted beside the leader, by that node's accesses alone.
    with fleet(tmp_path, 2) as (etcd, mounts, daemons):
        (lead,) = wait_for(lambda: leaders(daemons), lambda ls: len(ls) == 1, timeout=20)
        follow = 1 - lead
        for i in range(20):
            store_page(mounts[follow] / "ns" / NS_A, page_name(i), 4096)
        backing = tmp_path / "backing" / "ns" / NS_A
        gc = ["--root", str(mounts[follow]), "gc", "--yes", "--max-bytes", "40000"]
        env = {"CACHEMGR_STATE_DIR": str(tmp_path / f"state{follow}")}
        # with the daemon's coordinator, and from a shell without it (the daemon on this
        # node's port says the root is a fleet's)
        with_coordinator = {**env, "CACHEMGR_FLEET_COORDINATOR": etcd.coordinator}
        port = daemons[follow].url.rsplit(":", 1)[1]
        for shell in (with_coordinator, {**env, "CACHEMGR_PORT": port}):
            r = cli(*gc, env=shell)
            assert r.returncode == 1, r.stdout
            assert "fleet's shared root" in r.stderr
            assert f"node{lead} holds the lease" in r.stderr
            assert f"{daemons[lead].url}/v1/gc" in r.stderr
            assert len(list(backing.glob("*.bin"))) == 20
        etcd.stop()
        r = cli(*gc, env=with_coordinator)
        assert r.returncode == 1
        assert "coordinator did not answer" in r.stderr
        assert len(list(backing.glob("*.bin"))) == 20
        assert (
            cli(*gc[:-3], "--dry-run", "--max-bytes", "40000", env=with_coordinator).returncode == 0
        )


def leader_lease(etcd: Etcd, lease: str = "cachemgr-gc") -> int | None:
    """The lease id the leader key is attached to, from etcd's JSON gateway (None: no key)."""
    key = base64.b64encode(f"/cachemgr/{lease}/leader".encode()).decode()
    r = httpx.post(f"http://{etcd.endpoint}/v3/kv/range", json={"key": key}, timeout=5)
    kvs = r.json().get("kvs")
    return int(kvs[0]["lease"]) if kvs else None


def test_a_gc_run_ends_when_its_lease_is_revoked_even_if_the_node_wins_it_again(
    tmp_path: Path,
) -> None:
    # The fence asked whether the node's *current* term held: a lease revoked mid-run (an
    # operator forcing a failover) was lost and won again in one elector round, and the run
    # went on deleting by a plan made under the term it had lost.
    temps = 3000
    with fleet(tmp_path, 1, gc_tmp_ttl="0s", gc_delete_rate=200, gc_interval="1h") as (
        etcd,
        _,
        (node,),
    ):
        wait_for(lambda: leaders([node]), lambda ls: ls == [0], timeout=20)
        ns = tmp_path / "backing" / "ns" / NS_A
        for _ in range(temps):
            (ns / f".{uuid.uuid4().hex}.tmp").write_bytes(b"t")

        def left() -> int:
            return len(list(ns.glob(".*.tmp")))

        run = threading.Thread(
            target=lambda: httpx.post(f"{node.url}/v1/gc", timeout=120), daemon=True
        )
        run.start()
        wait_for(left, lambda n: n <= temps - 256, timeout=30, what="a first chunk deleted")
        lease = leader_lease(etcd)
        httpx.post(f"http://{etcd.endpoint}/v3/lease/revoke", json={"ID": lease}, timeout=5)
        wait_for(
            lambda: leader_lease(etcd), lambda n: n not in (None, lease), timeout=10, what="won"
        )
        at_win = left()
        time.sleep(4)  # three paced chunks' worth (256 files, then ~1.3 s)
        assert left() >= at_win - 256  # at most the chunk the fence had passed
        run.join(60)
        assert node.get("/v1/fleet").json()["leading"]


def fleet_findings(r: subprocess.CompletedProcess[str]) -> dict[str, str]:
    found = json.loads(r.stdout)
    return {f["code"]: f["severity"] for f in found if f["code"].startswith("fleet-")}


def test_doctor_and_status_say_when_this_node_cannot_reach_the_coordinator(
    tmp_path: Path,
) -> None:
    # A node without etcd logged one warning and set a gauge; doctor and status said nothing.
    with fleet(tmp_path, 2) as (etcd, mounts, daemons):
        (lead,) = wait_for(lambda: leaders(daemons), lambda ls: len(ls) == 1, timeout=20)

        def on(i: int, *args: str) -> subprocess.CompletedProcess[str]:
            env = {
                "CACHEMGR_STATE_DIR": str(tmp_path / f"state{i}"),
                "CACHEMGR_PORT": daemons[i].url.rsplit(":", 1)[1],
            }
            return cli("--root", str(mounts[i]), *args, env=env)

        for i in range(2):
            assert fleet_findings(on(i, "doctor", "--json")) == {}
        follow = 1 - lead
        said = on(follow, "status").stdout
        assert f"fleet: node node{follow}; GC leader node{lead} at {daemons[lead].url}" in said
        assert f"fleet: this node (node{lead}) leads GC" in on(lead, "status").stdout
        etcd.stop()
        wait_for(lambda: daemons[follow].get("/v1/fleet").json()["coordinator_up"], lambda u: not u)
        r = on(follow, "doctor", "--json")
        assert r.returncode == 2
        assert fleet_findings(r) == {"fleet-coordinator-down": "error"}
        said = on(follow, "status").stdout
        assert f"warning: fleet: this node (node{follow}) gets no answer" in said


def test_doctor_names_a_follower_the_leader_does_not_hear() -> None:
    follower = {
        "enabled": True,
        "node": "node1",
        "leading": False,
        "leader": "node0",
        "leader_url": "http://10.0.0.5:9477",
        "coordinator_up": True,
        "ship_age_seconds": 300.0,
    }
    (found,) = lint_fleet(follower)
    assert (found.code, found.severity) == ("fleet-not-shipping", "warning")
    assert "node0 at http://10.0.0.5:9477" in found.message
    assert lint_fleet({**follower, "ship_age_seconds": 4.0}) == []
    leader = {**follower, "node": "node0", "leading": True, "ship_age_seconds": 0.0}
    nodes = [
        {"node": "node1", "last_summary_age_seconds": 2.0},
        {"node": "node2", "last_summary_age_seconds": 600.0},
    ]
    (found,) = lint_fleet({**leader, "nodes": nodes})
    assert found.code == "fleet-node-silent"
    assert "node2" in found.message
    assert lint_fleet({**leader, "leader": None, "leading": False}) != []
    assert lint_fleet({"enabled": False}) == []


def test_a_follower_the_leader_refuses_says_so_in_its_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A follower whose token the leader refused logged each failure at debug only: its own
    # log said nothing while none of its accesses reached GC's order.
    need_binaries()
    with ExitStack() as stack:
        etcd = stack.enter_context(running_etcd(tmp_path))
        mounts = stack.enter_context(bindfs_nodes(tmp_path / "backing", tmp_path / "mnt", 2))
        create_root(Layout.at(mounts[0], tmp_path / "state0"))
        register_namespace(Layout.at(mounts[0], tmp_path / "state0"), NS_A)
        daemons = []
        for i, token in enumerate(("right", "wrong")):
            settings = node_settings(mounts[i], tmp_path / f"state{i}", etcd, i, token=token)
            daemons.append(stack.enter_context(running_daemon(settings)))
            wait_for(lambda: leaders(daemons), lambda ls: ls == [0], timeout=20)

        def said() -> list[str]:
            return [
                r.getMessage()
                for r in caplog.records
                if r.name == "cachemgr.fleet.accesses" and r.levelno == logging.WARNING
            ]

        store_page(mounts[1] / "ns" / NS_A, page_name(1))
        (line,) = wait_for(said, bool, timeout=20, what="the follower's warning")
        assert "takes none of this node's accesses" in line


def test_a_leader_cut_off_from_etcd_no_longer_names_itself_the_leader(tmp_path: Path) -> None:
    # Its lease lapsed with the coordinator down, and GET /v1/fleet still said
    # "leader": itself, "leading": false: a fleet that looked led while no node deleted.
    with fleet(tmp_path, 1) as (etcd, _, (node,)):
        wait_for(lambda: leaders([node]), lambda ls: ls == [0], timeout=20)
        etcd.stop()
        seen = wait_for(
            lambda: node.get("/v1/fleet").json(), lambda f: f["leader"] is None, timeout=3 * TTL
        )
        assert (seen["leading"], seen["leader_url"], seen["coordinator_up"]) == (False, None, False)
        r = node.post("/v1/gc")  # refused, saying why
        assert r.status_code == 409
        assert "no node holds the fleet's GC lease now" in r.json()["detail"]
        assert "coordinator does not answer" in r.json()["detail"]


def test_a_temp_whose_mtime_lags_the_leaders_clock_waits_to_be_seen_unchanged(
    tmp_path: Path,
) -> None:
    # A temp's mtime is the file server's clock (NFS) or the writing node's (CephFS), not the
    # leader's: with that clock two hours behind, a page being written looked two hours old
    # and the leader's sweep deleted it under the writer.
    with fleet(tmp_path, 1, gc_tmp_ttl="2s", gc_interval="1h") as (_, _, (node,)):
        wait_for(lambda: leaders([node]), lambda ls: ls == [0], timeout=20)
        ns = tmp_path / "backing" / "ns" / NS_A
        behind = time.time() - 7200
        writing, crashed = ns / f".{uuid.uuid4().hex}.tmp", ns / f".{uuid.uuid4().hex}.tmp"
        for temp in (writing, crashed):
            temp.write_bytes(b"p" * 4096)
            os.utime(temp, (behind, behind))
        assert node.post("/v1/gc").status_code == 200
        assert writing.exists() and crashed.exists()  # first seen now: not two hours ago
        for _ in range(3):  # the writer goes on; the crashed write's file stays as it was
            time.sleep(1)
            with open(writing, "ab") as f:
                f.write(b"p" * 4096)
            os.utime(writing, (behind, behind + 1))
            behind += 1
        assert node.post("/v1/gc").status_code == 200
        assert writing.exists()
        assert not crashed.exists()  # unchanged for tmp_ttl by the leader's own clock


def test_a_fleet_daemon_on_a_loopback_address_says_other_nodes_cannot_reach_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Fleet mode on the default host advertised http://127.0.0.1:<port>: on each other node
    # that is its own daemon, which answers "not the GC leader", so no node's accesses
    # reached the leader, and nothing said why.
    def said() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == "cachemgr.daemon.fleet" and r.levelno == logging.WARNING
        ]

    with fleet(tmp_path, 1) as (_, _, (node,)):
        assert node.get("/v1/fleet").json()["node"] == "node0"
        (line,) = said()
        assert "other nodes cannot reach this daemon" in line
    caplog.clear()
    (tmp_path / "b").mkdir()
    with fleet(tmp_path / "b", 1, fleet_advertise_url="http://10.0.0.5:9477") as (_, _, (node,)):
        wait_for(lambda: node.get("/v1/fleet").json()["leader_url"], bool, timeout=20)
        assert node.get("/v1/fleet").json()["leader_url"] == "http://10.0.0.5:9477"
        assert said() == []


def test_an_ex_leader_counts_its_shipping_silence_from_the_handover(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # While leading, a node's "leader took my accesses" time stood still: after a handover
    # its first failure to reach the new leader read as minutes of silence, and warned.
    with running_etcd(tmp_path) as etcd:
        endpoints = [("127.0.0.1", etcd.port)]
        first = Elector(EtcdCoordinator(endpoints, "l", TTL), LeaderRecord("a", "http://a"), RENEW)
        shipper = AccessShipper(first, capacity=100, token=None)
        try:
            first.round()
            assert first.leading()
            shipper.last_taken -= 2 * SILENT  # a long term, shipping nothing meanwhile
            shipper.ship()
            lease = leader_lease(etcd, "l")
            httpx.post(f"http://{etcd.endpoint}/v3/lease/revoke", json={"ID": lease}, timeout=5)
            other = EtcdCoordinator(endpoints, "l", TTL)
            assert other.campaign(LeaderRecord("b", "http://127.0.0.1:9")) is not None
            first.round()
            assert not first.leading() and first.leader is not None
            shipper.record("r", NS_A, page_name(1))
            shipper.ship()  # the new leader's URL answers nothing
            assert shipper.failures == 1
            shipped = "cachemgr.fleet.accesses"
            assert not [r for r in caplog.records if r.name == shipped and r.levelno > 20]
            other.close()
        finally:
            shipper.start()  # and stopped: its loop closes its HTTP client on the way out
            shipper.stop(5)
            first.coordinator.close()
