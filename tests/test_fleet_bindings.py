"""Namespaces and bindings across a fleet's nodes (issue #24, item 4): instance names carry the
node, an identity change on one node leaves a namespace another node's server still uses, GC
drops only what no node binds, and purge works from any node. Real etcd, real bindfs nodes,
`cachemgr init` and `purge` as the servers' hosts run them."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from cachemgr.fs.root import create_root
from cachemgr.gc import drop as gc_drop
from cachemgr.layout import Layout
from cachemgr.ns import purge as purge_mod
from cachemgr.ns import registry as nsreg
from cachemgr.ns.bindings import catch_up
from cachemgr.state.store import Store
from tests.daemon_helpers import RunningDaemon, register_namespace, running_daemon, store_page
from tests.fleet_bed import Etcd, bindfs_nodes, need_binaries, running_etcd
from tests.nsfixtures import cli, page_name
from tests.polling import wait_for
from tests.test_fleet import leaders, node_settings
from tests.test_identity import make_model
from tests.test_init import CMD, NO_STORAGE_ENV

pytestmark = pytest.mark.fleet


class Bed:
    """Nodes (bindfs mounts of one backing dir, each with its own state dir) and a real etcd;
    `cachemgr` run as on node i."""

    def __init__(self, tmp: Path, etcd: Etcd, mounts: list[Path]) -> None:
        self.tmp, self.etcd, self.mounts = tmp, etcd, mounts
        self.model = make_model(tmp / "model")
        self.backing = tmp / "backing"

    def env(self, i: int) -> dict[str, str]:
        return {
            **NO_STORAGE_ENV,
            "CACHEMGR_FLEET_COORDINATOR": self.etcd.coordinator,
            "CACHEMGR_NODE_NAME": f"node{i}",
            "CACHEMGR_STATE_DIR": str(self.state(i)),
        }

    def state(self, i: int) -> Path:
        return self.tmp / f"state{i}"

    def layout(self, i: int) -> Layout:
        return Layout.at(self.mounts[i], self.state(i))

    def cachemgr(self, i: int, *args: str) -> str:
        out = cli("--root", str(self.mounts[i]), *args, env=self.env(i))
        assert out.returncode == 0, out.stderr
        return out.stdout

    def init(self, i: int, *extra: str, kv: str = "bfloat16") -> dict[str, Any]:
        launch = [*CMD.split(), "--model-path", str(self.model), "--kv-cache-dtype", kv]
        result: dict[str, Any] = json.loads(
            self.cachemgr(i, "init", "--json", *extra, "--", *launch)
        )
        return result

    def pages(self, ns_id: str) -> int:
        ns_dir = self.backing / "ns" / ns_id
        return sum(1 for n in os.listdir(ns_dir) if n.endswith(".bin")) if ns_dir.is_dir() else -1

    def fill(self, i: int, ns_id: str, n: int) -> None:
        for k in range(n):  # as HiCacheFile stores them: a temp file, then a rename
            store_page(self.mounts[i] / "ns" / ns_id, page_name(k), 10)


@contextmanager
def bed(tmp: Path, n: int) -> Iterator[Bed]:
    need_binaries()
    with ExitStack() as stack:
        etcd = stack.enter_context(running_etcd(tmp))
        mounts = stack.enter_context(bindfs_nodes(tmp / "backing", tmp / "mnt", n))
        create_root(Layout.at(mounts[0], tmp / "state0"))
        yield Bed(tmp, etcd, mounts)


@contextmanager
def daemons(b: Bed, **kw: object) -> Iterator[list[RunningDaemon]]:
    with ExitStack() as stack:
        yield [
            stack.enter_context(
                running_daemon(node_settings(m, b.state(i), b.etcd, i, gc_interval="1h", **kw))
            )
            for i, m in enumerate(b.mounts)
        ]


def test_one_instance_name_on_two_nodes_is_two_instances_and_the_last_to_leave_purges(
    tmp_path: Path,
) -> None:
    with bed(tmp_path, 2) as b:
        first = b.init(0)
        assert first["instance"] == "default@node0"
        second = b.init(1)  # node1's server of the same name: another instance, same identity
        assert (second["instance"], second["outcome"]) == ("default@node1", "joined")
        old = first["ns_id"]
        assert second["ns_id"] == old
        b.fill(0, old, 5)
        binds = sorted(p.name for p in (b.backing / "ns").glob("*.bind"))
        assert binds == ["default@node0.bind", "default@node1.bind"]

        moved = b.init(0, kv="fp8_e4m3")  # node0's server changes identity
        assert (moved["outcome"], moved["old_action"]) == ("changed", "kept")
        assert moved["old_users"] == ["default@node1"]  # a server on node1 still uses it
        assert b.pages(old) == 5

        last = b.init(1, kv="fp8_e4m3")  # the last binding goes: on_change (purge) applies
        assert (last["outcome"], last["old_action"], last["old_pages"]) == ("changed", "purged", 5)
        assert b.pages(old) == -1


def test_gc_drops_only_the_namespaces_no_node_binds(tmp_path: Path) -> None:
    """The leader keeps a namespace a server on another node bound after the leader last
    scanned, and drops the unbound ones (keep_unbound applies in a fleet now)."""
    with bed(tmp_path, 2) as b:
        bound = b.init(1)["ns_id"]
        b.init(1, "--on-change", "retain", kv="fp8_e4m3")  # node1 leaves it: unbound now
        unbound = [f"{k:016x}" for k in range(1, 4)]
        for ns in unbound:
            register_namespace(b.layout(0), ns)
        # min_age keeps them all until the run below (the leader's GC runs when elected)
        with daemons(b, gc_keep_unbound=0, gc_min_age="1h") as ds:
            (lead,) = wait_for(lambda: leaders(ds), lambda ls: len(ls) == 1, timeout=20)
            wait_for(lambda: set(ds[lead].namespaces()), lambda s: {bound, *unbound} <= s)
            other = 1 - lead
            # a server on the other node binds it (the leader's DB has it unbound)
            assert b.init(other, "--on-change", "retain")["ns_id"] == bound

            r = ds[lead].post("/v1/gc", json={"min_age": 0})
            assert r.status_code == 200, r.text
            dropped = {s["namespace_id"] for s in r.json()["steps"] if s["reason"] == "unbound"}
            assert bound not in dropped  # not even planned: the leader read node1's binding
            assert set(unbound) <= dropped
            assert (b.backing / "ns" / bound).is_dir()
            assert not any((b.backing / "ns" / ns).exists() for ns in unbound)
            status = ds[lead].namespaces()[bound]
            assert status["instances"] == [f"default@node{other}"]


def test_purge_from_any_node(tmp_path: Path) -> None:
    """`cachemgr purge --instance` of another node's instance, and POST /purge on a follower:
    a namespace bound on another node comes back empty (its server keeps writing there), and
    the leader's index forgets the pages the follower's purge took."""
    with bed(tmp_path, 2) as b:
        ns = b.init(0)["ns_id"]
        with daemons(b) as ds:
            (lead,) = wait_for(lambda: leaders(ds), lambda ls: len(ls) == 1, timeout=20)
            follow = 1 - lead
            b.fill(lead, ns, 4)
            wait_for(lambda: ds[lead].namespaces()[ns]["pages"], lambda n: n == 4)

            out = b.cachemgr(1, "purge", "--instance", "default@node0", "--yes", "--json")
            (purged,) = json.loads(out)["result"]["purged"]
            assert (purged["ns_id"], purged["recreated"]) == (ns, True)
            assert b.pages(ns) == 0  # recreated empty: node0's server is bound to it
            wait_for(lambda: ds[lead].namespaces()[ns]["pages"], lambda n: n == 0)

            b.fill(lead, ns, 3)
            wait_for(lambda: ds[lead].namespaces()[ns]["pages"], lambda n: n == 3)
            r = ds[follow].post("/v1/purge", json={"namespace": ns})
            assert r.status_code == 200, r.text
            assert r.json()["purged"] == [
                {"namespace": ns, "pages": 3, "bytes": 30, "recreated": True}
            ]
            assert b.pages(ns) == 0
            wait_for(lambda: ds[lead].namespaces()[ns]["pages"], lambda n: n == 0, timeout=20)


def test_a_daemon_started_before_another_node_binds_purges_as_if_it_knew(tmp_path: Path) -> None:
    """node0's daemon mirrors the bindings as of its start; node1's server binds the namespace
    after. node0's identity change keeps it (node1 still uses it), and a purge through node0's
    daemon recreates it empty with its manifest, as for any bound namespace."""
    with bed(tmp_path, 2) as b:
        ns = b.init(0)["ns_id"]
        b.fill(0, ns, 4)
        with daemons(b) as ds:
            wait_for(lambda: ds[0].namespaces()[ns]["pages"], lambda n: n == 4, timeout=20)
            assert b.init(1)["outcome"] == "joined"  # after node0's daemon read the files
            moved = b.init(0, kv="fp8_e4m3")
            assert (moved["old_action"], moved["old_users"]) == ("kept", ["default@node1"])
            assert b.pages(ns) == 4
            r = ds[0].post("/v1/purge", json={"namespace": ns})
            assert r.status_code == 200, r.text
            assert r.json()["purged"] == [
                {"namespace": ns, "pages": 4, "bytes": 40, "recreated": True}
            ]
            assert b.pages(ns) == 0
            assert (b.backing / "ns" / f"{ns}.json").is_file()
            assert ds[0].namespaces()[ns]["instances"] == ["default@node1"]


@pytest.mark.parametrize("selector", ["unbound", "namespace"])
def test_a_purge_planned_before_another_node_binds_leaves_that_server_its_dir(
    tmp_path: Path, selector: str
) -> None:
    """A purge is planned, and its targets' pages counted (seconds for a large namespace), on
    node0's view of the bindings; node1's server binds the namespace meanwhile. The purge reads
    the binding files again before it moves anything: an unbound-only purge skips it, another
    recreates it empty and keeps its manifest; node1's server never loses its dir."""
    with bed(tmp_path, 2) as b:
        ns = b.init(0)["ns_id"]
        b.init(0, "--on-change", "retain", kv="fp8_e4m3")  # node0's server leaves it
        b.fill(0, ns, 3)
        layout = Layout.at(b.mounts[0], b.state(0), node="node0")
        with Store.open(layout.db_path) as store:
            catch_up(layout, store)  # as GC, init and POST /purge do before they plan
            plan = purge_mod.plan_purge(
                layout, store, **{selector: ns if selector != "unbound" else True}
            )
            assert [t.ns_id for t in plan.targets] == [ns]
            assert b.init(1)["instance"] == "default@node1"  # binds it, on node1
            result = purge_mod.execute_purge(plan, layout, store, actor="cli", reason="manual")
        assert (b.backing / "ns" / f"{ns}.json").is_file()
        if selector == "unbound":
            assert (result.purged, b.pages(ns)) == ((), 3)
        else:
            assert [(p.ns_id, p.recreated) for p in result.purged] == [(ns, True)]
            assert b.pages(ns) == 0


def test_a_daemon_shows_the_bindings_other_nodes_made_since_it_started(tmp_path: Path) -> None:
    """Each daemon's /v1/status showed the other nodes' bindings as of its start (its last
    full rescan): node1's kept node0's instance on the namespace node0 had left (and purged),
    and none on the one it moved to, which it called unregistered. It reads the binding files
    and manifests when asked."""
    with bed(tmp_path, 2) as b:
        old = b.init(0)["ns_id"]
        with daemons(b) as ds:
            assert ds[1].namespaces()[old]["instances"] == ["default@node0"]
            moved = b.init(0, kv="fp8_e4m3")  # after node1's daemon read the files
            new = moved["ns_id"]
            assert new != old and moved["old_action"] == "purged", moved
            seen = ds[1].namespaces()
            assert seen[new]["instances"] == ["default@node0"], seen
            assert seen[new]["state"] == "active", seen[new]  # its row: node0's DB
            assert seen.get(old, {"instances": []})["instances"] == [], seen
            assert b.init(1)["ns_id"] == old  # node1's own server, on the old identity
            assert ds[0].namespaces()[old]["instances"] == ["default@node1"]
            assert ds[1].namespaces()[old]["instances"] == ["default@node1"]


def test_a_bind_between_a_purges_last_read_and_its_rename_keeps_its_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window the root lock (one node's) leaves: node1's init binds after node0's purge
    read the binding files for the last time, before it renames the dir. The purge reads them
    once more after the rename (and the manifest's removal) and makes both again."""
    with bed(tmp_path, 2) as b:
        ns = b.init(0)["ns_id"]
        b.init(0, "--on-change", "retain", kv="fp8_e4m3")  # node0's server leaves it
        b.fill(0, ns, 3)
        layout = Layout.at(b.mounts[0], b.state(0), node="node0")
        rename = purge_mod.rename_to_trash

        def bind_first(*args: Any, **kw: Any) -> str | None:
            assert b.init(1)["instance"] == "default@node1"  # in the window: a real init
            return rename(*args, **kw)

        monkeypatch.setattr(purge_mod, "rename_to_trash", bind_first)
        with Store.open(layout.db_path) as store:
            result = purge_mod.purge(layout, store, actor="cli", reason="manual", namespace=ns)
            assert [(p.ns_id, p.recreated) for p in result[1].purged] == [(ns, True)]
            assert purge_mod.nsreg.instances_of(store, ns) == ("default@node1",)
        assert (b.backing / "ns" / f"{ns}.json").is_file()
        assert b.pages(ns) == 0  # its dir, empty, for node1's server
        listed = json.loads(b.cachemgr(1, "ls", "--json"))["namespaces"]
        assert {n["ns_id"]: n["state"] for n in listed}[ns] == "bound"


def test_a_purge_between_an_inits_dir_check_and_its_bind_leaves_it_its_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other side of that window: node1's init made sure of the dir and manifest, then
    node0's purge read no binding for it and moved both away, then node1 wrote its binding.
    The init makes sure of them once more after it binds."""
    with bed(tmp_path, 2) as b:
        ns = b.init(0)["ns_id"]
        b.init(0, "--on-change", "retain", kv="fp8_e4m3")  # node0's server leaves it
        b.fill(0, ns, 3)
        bind = nsreg.bind

        def purge_first(*args: Any, **kw: Any) -> str | None:
            monkeypatch.setattr(nsreg, "bind", bind)
            b.cachemgr(0, "purge", "--namespace", ns, "--yes")  # a real purge, on node0
            assert not (b.backing / "ns" / ns).exists()
            return bind(*args, **kw)

        monkeypatch.setattr(nsreg, "bind", purge_first)
        assert b.init(1)["ns_id"] == ns
        assert (b.backing / "ns" / f"{ns}.json").is_file()
        assert b.pages(ns) == 0  # its dir, empty, for node1's server
        listed = json.loads(b.cachemgr(1, "ls", "--json"))["namespaces"]
        assert {n["ns_id"]: n["state"] for n in listed}[ns] == "bound"


def test_a_bind_in_gcs_window_before_its_drop_renames_keeps_the_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GC's drop of an unbound namespace has the purge's window: a server on the other node
    binds it after the leader's last read of the binding files, before the rename."""
    with bed(tmp_path, 2) as b:
        ns = b.init(1)["ns_id"]
        b.init(1, "--on-change", "retain", kv="fp8_e4m3")  # node1 leaves it: unbound now
        with daemons(b, gc_keep_unbound=0, gc_min_age="1h") as ds:
            (lead,) = wait_for(lambda: leaders(ds), lambda ls: len(ls) == 1, timeout=20)
            wait_for(lambda: set(ds[lead].namespaces()), lambda s: ns in s)
            other = 1 - lead
            rename = gc_drop.rename_to_trash

            def bind_first(layout: Layout, ns_id: str, **kw: Any) -> str | None:
                monkeypatch.setattr(gc_drop, "rename_to_trash", rename)
                assert b.init(other, "--on-change", "retain")["ns_id"] == ns
                return rename(layout, ns_id, **kw)

            monkeypatch.setattr(gc_drop, "rename_to_trash", bind_first)
            r = ds[lead].post("/v1/gc", json={"min_age": 0})
            assert r.status_code == 200, r.text
            assert [s["namespace_id"] for s in r.json()["steps"]] == [ns]  # it was dropped
            assert (b.backing / "ns" / ns).is_dir()  # and its dir made again, empty
            assert (b.backing / "ns" / f"{ns}.json").is_file()
            listed = json.loads(b.cachemgr(other, "ls", "--json"))["namespaces"]
            assert {n["ns_id"]: n["state"] for n in listed}[ns] == "bound"
