"""GC dropping an unbound namespace while init binds it again: the bound namespace survives."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachemgr.gc.execute import execute_gc
from cachemgr.layout import Layout
from cachemgr.ns import registry as nsreg
from cachemgr.ns.manifest import read_manifest
from cachemgr.ns.purge import execute_purge, plan_purge
from cachemgr.state.store import Store
from tests.daemon_helpers import cli_argv
from tests.gc_helpers import NS, T0, Tree, page, policy
from tests.nsfixtures import cli, page_name
from tests.polling import wait_for
from tests.test_identity import make_model

NO_STORAGE_ENV = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": ""}


@pytest.fixture
def tree(root: Path) -> Iterator[Tree]:
    t = Tree.at(root)
    yield t
    t.close()


def init(root: Path, model: Path, page_size: int) -> dict[str, object]:
    launch = [
        "sglang",
        "serve",
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "file",
        "--model-path",
        str(model),
        "--page-size",
        str(page_size),
    ]
    out = cli(
        "--root",
        str(root),
        "init",
        "--json",
        "--on-change",
        "retain",
        "--",
        *launch,
        env=NO_STORAGE_ENV,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    return result


def state_of(root: Path, ns: str) -> tuple[str, tuple[str, ...]]:
    store = Store.open(Layout.at(root).db_path)
    try:
        row = store.conn.execute("SELECT state FROM namespaces WHERE id = ?", (ns,)).fetchone()
        return row[0], nsreg.instances_of(store, ns)
    finally:
        store.close()


def _deleting(ns_dir: Path, pages: int, gc: subprocess.Popen[str]) -> bool:
    """Whether GC has started deleting the dir's pages; fails at once if GC exited before."""
    if not ns_dir.is_dir() or len(os.listdir(ns_dir)) < pages:
        return True
    assert gc.poll() is None, gc.communicate()
    return False


def test_init_rebinding_during_a_slow_gc_keeps_its_namespace(root: Path, tmp_path: Path) -> None:
    model = make_model(tmp_path / "model")
    old = str(init(root, model, 64)["ns_id"])
    for i in range(600):
        (root / "ns" / old / page_name(i)).write_bytes(b"k" * 10)
    assert init(root, model, 32)["ns_id"] != old  # the 64 namespace is now unbound
    gc = subprocess.Popen(
        [
            *cli_argv(root),
            "gc",
            "--yes",
            "--min-age",
            "0",
            "--delete-rate",
            "200",
        ],
        env={**os.environ, "CACHEMGR_GC_KEEP_UNBOUND": "0"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: _deleting(root / "ns" / old, 600, gc), timeout=60, what="GC to delete")
        assert init(root, model, 64)["ns_id"] == old  # bound again while GC deletes
        _, err = gc.communicate(timeout=60)
    finally:
        if gc.poll() is None:
            gc.kill()
            gc.wait()
    assert gc.returncode == 0, err
    assert (root / "ns" / old).is_dir()
    assert os.listdir(root / "ns" / old) == []  # its old pages went with the drop, not after
    assert (root / "ns" / f"{old}.json").is_file()
    assert state_of(root, old) == ("active", ("default",))
    ls = json.loads(cli("--root", str(root), "ls", "--json").stdout)
    assert {n["ns_id"]: n["state"] for n in ls["namespaces"]}[old] == "bound"


def test_a_namespace_bound_while_gc_drops_it_is_untouched(tree: Tree) -> None:
    tree.add_namespace(NS, active=T0)
    tree.write(NS, [page(i) for i in range(20)], at=T0)
    plan = tree.plan(policy(keep_unbound=0), now=T0 + 100)
    assert [s.reason for s in plan.steps] == ["unbound"]
    bound: list[bool] = []

    def bind_once(files: int, size: int) -> None:
        """What an init does, run while GC deletes (it takes the root lock too)."""
        if bound:
            return
        bound.append(True)
        nsreg.ensure_namespace(
            tree.layout, tree.store, ns_id=NS, digest=NS * 4, identity={}, now=T0 + 100
        )
        with tree.store.transaction():
            nsreg.bind(tree.layout, tree.store, "default", NS, T0 + 100)

    report = execute_gc(plan, tree.run(clock=lambda: T0 + 100), progress=bind_once)
    assert bound and report.files == 20
    assert tree.files(NS) == set()  # a fresh empty dir: init's create path
    manifest = read_manifest(tree.layout, NS)
    assert manifest is not None and manifest.ns_id == NS
    row = tree.store.conn.execute("SELECT state FROM namespaces WHERE id = ?", (NS,)).fetchone()
    assert row[0] == "active"
    assert nsreg.instances_of(tree.store, NS) == ("default",)
    audit = tree.store.conn.execute("SELECT action, reason, pages FROM audit").fetchall()
    assert [tuple(r) for r in audit] == [("evict", "unbound", 20)]


def test_plan_then_bind_then_execute_leaves_the_namespace(tree: Tree) -> None:
    tree.add_namespace(NS, active=T0)
    tree.write(NS, [page(i) for i in range(5)], at=T0)
    plan = tree.plan(policy(keep_unbound=0), now=T0 + 100)
    with tree.store.transaction():
        nsreg.bind(tree.layout, tree.store, "default", NS, T0 + 100)
    report = tree.execute(plan, now=T0 + 100)
    assert report.steps[0].skipped and report.files == 0
    assert tree.files(NS) == {page(i) for i in range(5)}


def test_a_stale_unbound_purge_plan_does_not_purge_twice(tree: Tree) -> None:
    tree.add_namespace(NS, active=T0)
    tree.write(NS, [page(i) for i in range(5)], at=T0)
    stale = plan_purge(tree.layout, tree.store, unbound=True)
    fresh = plan_purge(tree.layout, tree.store, namespace=NS)
    execute_purge(fresh, tree.layout, tree.store, actor="cli", reason="identity_change")
    execute_purge(stale, tree.layout, tree.store, actor="cli", reason="manual")
    rows = tree.store.conn.execute("SELECT action, reason, pages FROM audit").fetchall()
    assert [tuple(r) for r in rows] == [("purge", "identity_change", 5)]


def test_eviction_racing_a_purge_keeps_the_new_dirs_index_rows(tree: Tree) -> None:
    tree.add_namespace(NS, active=T0, bound=True)
    names = [page(i) for i in range(10)]
    tree.write(NS, names, at=T0)
    plan = tree.plan(policy(max_bytes=5_000), now=T0 + 100)
    assert [s.reason for s in plan.steps] == ["cap"]
    victim = plan.steps[0].names[0]
    purged: list[bool] = []

    def purge_and_rewrite(files: int, size: int) -> None:
        """A purge renames the dir away mid-chunk; the server then writes `victim` anew."""
        if purged:
            return
        purged.append(True)
        execute_purge(
            plan_purge(tree.layout, tree.store, namespace=NS),
            tree.layout,
            tree.store,
            actor="cli",
            reason="manual",
        )
        tree.write(NS, [victim], at=T0 + 100)

    report = execute_gc(plan, tree.run(clock=lambda: T0 + 100), progress=purge_and_rewrite)
    assert purged and tree.files(NS) == {victim}
    rows = tree.store.conn.execute("SELECT name FROM pages WHERE namespace_id = ?", (NS,))
    assert [r[0] for r in rows] == [victim]
    assert report.steps[0].skipped == "the namespace was purged during GC"


@pytest.mark.parametrize("name", ["backup", NS, f"{NS}.", f"{NS.upper()}.abc", f"x{NS}.abc"])
def test_gc_deletes_only_trash_entries_named_as_purge_names_them(tree: Tree, name: str) -> None:
    kept = tree.layout.trash / name
    kept.mkdir()
    (kept / page(1)).write_bytes(b"p" * 100)
    purged = tree.layout.trash / f"{NS}.18c0ffee"
    purged.mkdir()
    (purged / page(2)).write_bytes(b"p" * 100)
    plan = tree.plan(policy(), now=T0)
    assert [s.rel_dir for s in plan.steps] == [f".trash/{NS}.18c0ffee"]
    tree.execute(plan, now=T0)
    assert not purged.exists()
    assert os.listdir(kept) == [page(1)]


def test_a_drop_whose_gc_lease_lapsed_before_its_rename_leaves_the_namespace(tree: Tree) -> None:
    tree.add_namespace(NS, active=T0)
    tree.write(NS, [page(i) for i in range(20)], at=T0)
    plan = tree.plan(policy(keep_unbound=0), now=T0 + 100)
    assert [s.reason for s in plan.steps] == ["unbound"]
    # The step starts while this node leads; by the time it holds the root lock (a wait for
    # it, a pause) the lease is gone: the rename would take the whole namespace.
    answers = iter([True])
    run = tree.run(clock=lambda: T0 + 100, fence=lambda: next(answers, False))
    report = execute_gc(plan, run)
    assert report.files == 0
    assert tree.files(NS) == {page(i) for i in range(20)}
    assert not list((tree.layout.root / ".trash").iterdir())
    assert "this node no longer holds the GC lease" in report.warnings[-1]
