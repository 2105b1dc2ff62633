"""Empty results say so in words; --json stays JSON with empty lists."""

from __future__ import annotations

import json

from cachemgr.layout import Layout
from cachemgr.state.store import Store
from tests.nsfixtures import cli, make_ns


def _ok(*args: str) -> str:
    out = cli(*args)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_an_empty_root_says_no_namespaces_nothing_to_purge_nothing_to_delete(
    layout: Layout,
) -> None:
    root = ("--root", str(layout.root))
    assert _ok(*root, "ls").splitlines() == [f"no namespaces under {layout.root}"]
    status = _ok(*root, "status", "--port", "1").splitlines()
    assert status[0] == f"no namespaces under {layout.root} (from disk)"
    assert status[1].startswith("filesystem: ") and len(status) == 2
    for selector in ("--all", "--unbound"):
        purged = _ok(*root, "purge", selector, "--yes")
        assert purged.splitlines() == [f"nothing to purge ({selector[2:]})"]
    assert _ok(*root, "gc", "--yes").splitlines() == ["nothing to delete"]
    assert _ok(*root, "gc", "--dry-run").splitlines() == ["nothing to delete"]


def test_empty_results_in_json_stay_json(layout: Layout) -> None:
    root = ("--root", str(layout.root))
    assert json.loads(_ok(*root, "ls", "--json"))["namespaces"] == []
    assert json.loads(_ok(*root, "status", "--json", "--port", "1"))["namespaces"] == []
    assert json.loads(_ok(*root, "purge", "--all", "--yes", "--json"))["result"]["purged"] == []
    for args in (["gc", "--yes", "--json"], ["gc", "--dry-run", "--json"]):
        report = json.loads(_ok(*root, *args))
        assert (report["files"], report["steps"]) == (0, [])


def test_a_namespace_with_no_pages_is_still_listed(layout: Layout, store: Store) -> None:
    ns = make_ns(layout, store, "empty-model", pages=0, instance="srv")
    assert ns in _ok("--root", str(layout.root), "ls")
    assert ns in _ok("--root", str(layout.root), "status", "--port", "1")
    assert "nothing to delete" in _ok("--root", str(layout.root), "gc", "--yes")
