"""The namespace registry's parts: manifests, atomic writes, the root lock, scans, bindings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cachemgr.errors import ConfigError, ConflictError, StateError, UnsafePathError
from cachemgr.fs.atomic import write_atomic
from cachemgr.fs.locks import root_lock
from cachemgr.layout import Layout
from cachemgr.ns.manifest import Manifest, read_manifest, write_manifest
from cachemgr.ns.registry import (
    bind,
    check_instance,
    ensure_namespace,
    instances_of,
    list_namespaces,
    make_ns_dir,
)
from cachemgr.state.store import Store
from tests.nsfixtures import make_ns

NS = "0123456789abcdef"


def test_manifest_round_trips_and_leaves_no_temp(layout: Layout) -> None:
    m = Manifest(NS, NS * 2, {"kv_cache_dtype": "bfloat16", "page_size": 64}, 1.0, 2.0)
    write_manifest(layout, m)
    assert read_manifest(layout, NS) == m
    assert sorted(os.listdir(layout.ns_root)) == [f"{NS}.json"]
    data = json.loads(layout.manifest(NS).read_text())
    assert data["identity"]["page_size"] == 64 and data["manifest_version"] == 1


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{", "not JSON"),
        ('{"manifest_version": 1}', "no identity"),
        ('{"identity": {}, "manifest_version": 9}', "version 9"),
        ('{"identity": {}, "manifest_version": 1, "ns_id": "ffffffffffffffff"}', "names"),
    ],
)
def test_bad_manifests_are_state_errors(layout: Layout, content: str, needle: str) -> None:
    layout.manifest(NS).write_text(content)
    with pytest.raises(StateError, match=needle):
        read_manifest(layout, NS)


def test_manifest_symlink_is_not_followed(layout: Layout, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    layout.manifest(NS).symlink_to(target)
    with pytest.raises(StateError):
        read_manifest(layout, NS)


def test_write_atomic_replaces_whole_files(tmp_path: Path) -> None:
    path = tmp_path / "env"
    write_atomic(path, b"A=1\n")
    write_atomic(path, b"A=2\n")
    assert path.read_bytes() == b"A=2\n" and os.listdir(tmp_path) == ["env"]
    with pytest.raises(ConfigError, match="cannot write"):
        write_atomic(tmp_path / "missing" / "env", b"x")


def test_ensure_namespace_is_idempotent_and_refuses_another_digest(
    layout: Layout, store: Store
) -> None:
    assert ensure_namespace(layout, store, ns_id=NS, digest=NS * 2, identity={}, now=1.0)
    assert not ensure_namespace(layout, store, ns_id=NS, digest=NS * 2, identity={}, now=5.0)
    m = read_manifest(layout, NS)
    assert m is not None and (m.created_at, m.last_active_at) == (1.0, 5.0)
    other = NS + "f" * 16
    with pytest.raises(StateError, match="holds identity"):
        ensure_namespace(layout, store, ns_id=NS, digest=other, identity={}, now=6.0)
    with pytest.raises(ConfigError, match="not a prefix"):
        ensure_namespace(layout, store, ns_id=NS, digest="f" * 32, identity={}, now=6.0)


def test_unreadable_manifest_is_replaced(layout: Layout, store: Store) -> None:
    layout.manifest(NS).write_text("garbage")
    ensure_namespace(layout, store, ns_id=NS, digest=NS * 2, identity={"x": 1}, now=1.0)
    m = read_manifest(layout, NS)
    assert m is not None and m.identity == {"x": 1}


def test_make_ns_dir_refuses_a_symlink(layout: Layout, tmp_path: Path) -> None:
    (layout.ns_root / NS).symlink_to(tmp_path)
    with pytest.raises(UnsafePathError, match="symlink"):
        make_ns_dir(layout, NS)


def test_list_shows_states(layout: Layout, store: Store, tmp_path: Path) -> None:
    a = make_ns(layout, store, "a", instance="srv")
    b = make_ns(layout, store, "b")
    (layout.ns_root / ("c" * 16)).mkdir()
    (layout.ns_root / ("d" * 16)).symlink_to(tmp_path)
    layout.manifest("e" * 16).write_text("{")
    (layout.ns_root / ("e" * 16)).mkdir()
    (layout.ns_root / "not-an-id").mkdir()
    states = {n.ns_id: n.state for n in list_namespaces(layout, store)}
    assert states == {
        a: "bound",
        b: "unbound",
        "c" * 16: "no-manifest",
        "d" * 16: "unsafe",
        "e" * 16: "bad-manifest",
    }


def test_bindings(layout: Layout, store: Store) -> None:
    a = make_ns(layout, store, "a")
    with store.transaction():
        assert bind(layout, store, "two", a, 1.0) is None
        assert bind(layout, store, "one", a, 1.0) is None
    assert instances_of(store, a) == ("one", "two")
    with pytest.raises(ConfigError):
        check_instance("../etc")


def test_root_lock_excludes_another_process(layout: Layout) -> None:
    holder = textwrap.dedent(f"""
        import sys
        from cachemgr.layout import Layout
        from cachemgr.fs.locks import root_lock
        with root_lock(Layout.at({str(layout.root)!r})):
            print("held", flush=True)
            sys.stdin.readline()
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        with (
            pytest.raises(ConflictError, match=f"held by pid {proc.pid}"),
            root_lock(layout, timeout=0.2),
        ):
            pass
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
    with root_lock(layout, timeout=1), root_lock(layout, timeout=1):
        pass  # free again, and re-entrant within one thread
