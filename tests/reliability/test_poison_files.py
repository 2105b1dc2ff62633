"""Poison files under the root: a FIFO or a huge, deep or out-of-range manifest, a namespace
entry that is a symlink, a FIFO or a file, a symlinked .trash/ or trash entry.

Each poison is planted next to two healthy namespaces (one bound with pages, one unbound with
pages) and every command is run against the tree: none may hang, print a traceback or stop at
the poison. The poison is reported (ls/status state, doctor finding, purge `problems`, GC
warning) and left exactly as it was; the healthy namespaces are handled as usual.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachemgr.layout import Layout
from cachemgr.ns.manifest import MANIFEST_MAX_BYTES
from cachemgr.state.store import Store
from tests.daemon_helpers import wait_for
from tests.nsfixtures import cli, make_ns, ns_id_of
from tests.test_identity import make_model

HANG_SECONDS = 30.0
CMD = "sglang serve --enable-hierarchical-cache --hicache-storage-backend file --page-size 64"
# GC settings under which the healthy unbound namespace is dropped at once: a poisoned unbound
# namespace would be too, were it not left alone.
GC_ENV = {"CACHEMGR_GC_KEEP_UNBOUND": "0", "CACHEMGR_GC_MIN_AGE": "0s"}


@dataclass
class Tree:
    """A root with a bound (`bound`) and an unbound (`unbound`) healthy namespace and a poison."""

    layout: Layout
    bound: str
    unbound: str
    poison_ids: tuple[str, ...]  # namespace ids the poison makes bad ("" for .trash poisons)
    state: str  # what ls/status say about them: bad-manifest | unsafe | trash
    planted: dict[str, tuple[int, int, bytes]]  # path -> (mode, size, bytes or link target)

    @property
    def root(self) -> Path:
        return self.layout.root


def _fingerprint(path: Path) -> tuple[int, int, bytes]:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return st.st_mode, st.st_size, os.readlink(path).encode()
    if stat.S_ISREG(st.st_mode):
        return st.st_mode, st.st_size, path.read_bytes()
    if stat.S_ISDIR(st.st_mode):
        return st.st_mode, 0, "\0".join(sorted(os.listdir(path))).encode()
    return st.st_mode, st.st_size, b""


def _manifest_dict(layout: Layout, ns: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(layout.manifest(ns).read_text())
    return data


def _bad_manifest(layout: Layout, store: Store, name: str, write: Callable[[Path], None]) -> str:
    """A namespace with pages whose manifest `write` then spoils."""
    ns = make_ns(layout, store, name, pages=2)
    path = layout.manifest(ns)
    path.unlink()
    write(path)
    return ns


def _json_with(**fields: Any) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        ns = path.name.removesuffix(".json")
        data = {
            "ns_id": ns,
            "digest": ns * 2,
            "identity": {"kv_cache_dtype": "bfloat16"},
            "created_at": 1.7e9,
            "last_active_at": 1.7e9,
            "manifest_version": 1,
            "cachemgr_version": "0.1.0",
            **fields,
        }
        path.write_text(json.dumps(data))

    return write


def _deep(path: Path) -> None:
    path.write_bytes(b"[" * 200_000 + b"]" * 200_000)


def _oversize(path: Path) -> None:
    ns = path.name.removesuffix(".json")
    pad = "x" * (MANIFEST_MAX_BYTES + 10)
    _json_with(identity={"kv_cache_dtype": "bfloat16", "pad": pad})(path)
    assert path.stat().st_size > MANIFEST_MAX_BYTES and ns


MANIFEST_POISONS: dict[str, Callable[[Path], None]] = {
    "fifo-manifest": os.mkfifo,
    "deep-manifest": _deep,
    "nan-time": _json_with(last_active_at="NaN"),
    "huge-time": _json_with(created_at=1e308),
    "negative-time": _json_with(created_at=-5.0),
    "bool-version": _json_with(manifest_version=True),
    "oversize": _oversize,
}
ENTRY_POISONS = ("symlink-ns", "fifo-ns", "file-ns")
TRASH_POISONS = ("symlink-trash", "symlink-trash-entry")
POISONS = (*MANIFEST_POISONS, *ENTRY_POISONS, *TRASH_POISONS)


def build(layout: Layout, victim: Path, poison: str) -> Tree:
    store = Store.open(layout.db_path)
    try:
        bound = make_ns(layout, store, "healthy-bound", pages=3, instance="web")
        unbound = make_ns(layout, store, "healthy-unbound", pages=3)
        stale = layout.ns_dir(bound) / ".0123456789abcdef0123456789abcdef.tmp"
        stale.write_bytes(b"t" * 10)  # a crashed writer's temp: GC must sweep it whatever else
        os.utime(stale, (time.time() - 7200, time.time() - 7200))
        planted: list[Path] = []
        ids: tuple[str, ...] = ()
        if poison in MANIFEST_POISONS:
            write = MANIFEST_POISONS[poison]
            known = _bad_manifest(layout, store, f"{poison}-registered", write)
            lost = _bad_manifest(layout, store, f"{poison}-unregistered", write)
            with store.transaction():  # a lost DB: only the disk knows this one
                store.conn.execute("DELETE FROM namespaces WHERE id = ?", (lost,))
            ids = (known, lost)
            for ns in ids:
                planted += [layout.manifest(ns), layout.ns_dir(ns)]
            state = "bad-manifest"
        elif poison in ENTRY_POISONS:
            ns = ns_id_of(poison)
            path = layout.ns_dir(ns)
            if poison == "symlink-ns":
                path.symlink_to(victim)  # holds a page-named file: a deleter's bait
            elif poison == "fifo-ns":
                os.mkfifo(path)
            else:
                path.write_bytes(b"not a directory\n")
            ids, state, planted = (ns,), "unsafe", [path]
        elif poison == "symlink-trash":
            layout.trash.rmdir()
            layout.trash.symlink_to(victim)  # victim holds a name TRASH_RE accepts
            ids, state, planted = ("",), "trash", [layout.trash]
        else:
            entry = layout.trash / "badbadbadbad0002.abc"
            entry.symlink_to(victim)
            ids, state, planted = ("",), "trash", [entry]
    finally:
        store.close()
    fingerprints = {str(p): _fingerprint(p) for p in planted}
    return Tree(layout, bound, unbound, ids, state, fingerprints)


@pytest.fixture(params=POISONS)
def tree(request: pytest.FixtureRequest, layout: Layout, victim: Path) -> Iterator[Tree]:
    t = build(layout, victim, request.param)
    yield t
    assert {p: _fingerprint(Path(p)) for p in t.planted} == t.planted, "the poison was touched"


def run(tree: Tree, *args: str, env: dict[str, str] | None = None) -> Any:
    """`cachemgr --root ROOT ARGS` in this process; fails, rather than hangs, on a block."""
    box: list[Any] = []
    thread = threading.Thread(
        target=lambda: box.append(cli("--root", str(tree.root), *args, env=env)), daemon=True
    )
    thread.start()
    thread.join(HANG_SECONDS)
    if thread.is_alive():
        _unblock_fifos(tree.root)
        thread.join(5)
        pytest.fail(f"cachemgr {' '.join(args)} hung on the poison")
    (out,) = box
    assert "Traceback" not in out.stderr + out.stdout, out.stderr
    return out


def _unblock_fifos(root: Path) -> None:
    """Open every FIFO under the root for writing once, so a reader blocked on it returns."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            if stat.S_ISFIFO(os.lstat(path).st_mode):
                with contextlib.suppress(OSError):  # ENXIO: nobody is blocked on it
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def _healthy_untouched(tree: Tree) -> None:
    assert len(list(tree.layout.ns_dir(tree.bound).glob("*.bin"))) == 3
    assert len(list(tree.layout.ns_dir(tree.unbound).glob("*.bin"))) == 3


def _mentions_poison(text: str, tree: Tree) -> bool:
    if tree.state == "trash":
        return ".trash" in text
    return all(ns in text for ns in tree.poison_ids)


# --- reading commands ---


def test_ls_reports_the_poison_and_lists_the_rest(tree: Tree) -> None:
    out = run(tree, "ls", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    states = {n["ns_id"]: n["state"] for n in data["namespaces"]}
    assert states[tree.bound] == "bound" and states[tree.unbound] == "unbound"
    if tree.state == "trash":
        assert any(t["problem"] for t in data["trash"]), data["trash"]
    else:
        assert all(states[ns] == tree.state for ns in tree.poison_ids), states
    assert run(tree, "ls").returncode == 0  # the table too (times, sizes: nothing overflows)


def test_status_reports_the_poison_and_counts_the_rest(tree: Tree, free_port: int) -> None:
    out = run(tree, "status", "--json", "--port", str(free_port))
    assert out.returncode == 0, out.stderr
    by_id = {n["id"]: n for n in json.loads(out.stdout)["namespaces"]}
    assert by_id[tree.bound]["pages"] == 3 and by_id[tree.unbound]["pages"] == 3
    if tree.state != "trash":
        assert all(by_id[ns]["state"] == tree.state for ns in tree.poison_ids), by_id
    assert run(tree, "status", "--port", str(free_port)).returncode == 0


def test_doctor_reports_the_poison_as_an_error(tree: Tree) -> None:
    out = run(tree, "doctor", "--json")
    assert out.returncode == 2, out.stderr
    findings = json.loads(out.stdout)
    code = {"bad-manifest": "ns-bad-manifest", "unsafe": "ns-unsafe", "trash": "trash-unsafe"}
    mine = [f for f in findings if f["code"] == code[tree.state]]
    assert mine and _mentions_poison(" ".join(f["message"] for f in mine), tree), findings
    _healthy_untouched(tree)


# --- destructive commands ---


def _purge(tree: Tree, selector: str) -> dict[str, Any] | None:
    """`purge SELECTOR --yes --json`: exit 1 with the poison in `problems`, the JSON result;
    None when .trash/ is a symlink (no safe place to rename into: nothing moves, exit 2)."""
    out = run(tree, "purge", selector, "--yes", "--json")
    if tree.layout.trash.is_symlink():
        assert out.returncode == 2 and ".trash" in out.stderr, out.stderr
        _healthy_untouched(tree)
        return None
    assert out.returncode == 1, out.stderr
    assert out.stderr.count("cachemgr: error:") == 1
    data: dict[str, Any] = json.loads(out.stdout)
    assert _mentions_poison(" ".join(data["problems"]), tree), data
    return data


def test_purge_all_purges_the_healthy_and_reports_the_poison(tree: Tree) -> None:
    data = _purge(tree, "--all")
    if data is None:
        return
    purged = {p["ns_id"] for p in data["result"]["purged"]}
    assert {tree.bound, tree.unbound} <= purged
    assert not set(tree.poison_ids) & purged
    assert list(tree.layout.ns_dir(tree.bound).iterdir()) == []  # bound: recreated empty
    assert not tree.layout.ns_dir(tree.unbound).exists()


def test_purge_unbound_leaves_the_poison_and_the_bound_alone(tree: Tree) -> None:
    if _purge(tree, "--unbound") is None:
        return
    assert not tree.layout.ns_dir(tree.unbound).exists()
    assert len(list(tree.layout.ns_dir(tree.bound).glob("*.bin"))) == 3


def test_gc_dry_run_plans_the_rest_and_warns(tree: Tree) -> None:
    out = run(tree, "gc", "--dry-run", "--json", env=GC_ENV)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    if tree.state != "unsafe":  # a stray entry GC never acts on needs no warning from it
        assert _mentions_poison(" ".join(report["warnings"]), tree), report
    _healthy_untouched(tree)


def test_gc_drops_the_healthy_unbound_and_never_the_poison(tree: Tree) -> None:
    out = run(tree, "gc", "--yes", "--json", env=GC_ENV)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert not list(tree.layout.ns_dir(tree.bound).glob(".*.tmp"))  # the stale temp swept
    assert len(list(tree.layout.ns_dir(tree.bound).glob("*.bin"))) == 3
    if tree.layout.trash.is_symlink():  # no drop without a safe .trash/, the rest still runs
        assert _mentions_poison(" ".join(report["warnings"]), tree), report
        return
    assert not tree.layout.ns_dir(tree.unbound).exists()
    if tree.state == "bad-manifest":
        assert _mentions_poison(" ".join(report["warnings"]), tree), report


def test_init_of_another_identity_succeeds(tree: Tree, tmp_path: Path) -> None:
    model = make_model(tmp_path / "model")
    launch = [*CMD.split(), "--model-path", str(model)]
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": ""}
    out = run(tree, "init", "--instance", "other", "--json", "--", *launch, env=env)
    assert out.returncode == 0, out.stderr
    assert Path(json.loads(out.stdout)["storage_dir"]).is_dir()
    _healthy_untouched(tree)


def test_init_replaces_its_own_poisoned_manifest(layout: Layout, tmp_path: Path) -> None:
    model = make_model(tmp_path / "model")
    launch = [*CMD.split(), "--model-path", str(model)]
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": ""}
    tree = Tree(layout, "", "", (), "", {})
    first = run(tree, "init", "--json", "--", *launch, env=env)
    ns = json.loads(first.stdout)["ns_id"]
    layout.manifest(ns).unlink()
    os.mkfifo(layout.manifest(ns))
    out = run(tree, "init", "--json", "--", *launch, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ns_id"] == ns
    assert _manifest_dict(layout, ns)["ns_id"] == ns  # a regular, valid manifest again


# --- the daemon ---


def _serve(layout: Layout, env: dict[str, str]) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "cachemgr", "--root", str(layout.root), "serve", "--port", "0"]
    full_env = {**os.environ, "CACHEMGR_LOG_FORMAT": "json", **env}
    return subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=full_env
    )


def _url(proc: subprocess.Popen[str], lines: list[str]) -> str:
    assert proc.stderr is not None
    deadline = time.monotonic() + HANG_SECONDS
    while not (lines and "serving" in lines[-1]):
        assert time.monotonic() < deadline, "".join(lines)
        line = proc.stderr.readline()
        assert line, "".join(lines)
        lines.append(line)
    match = re.search(r"http://\S+", lines[-1])
    assert match, lines[-1]
    return match.group(0)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.parametrize("poison", ["all-ns-poisons", "symlink-trash"])
def test_daemon_becomes_ready_reports_and_stops_on_the_first_sigterm(
    layout: Layout, victim: Path, poison: str
) -> None:
    """Every namespace poison at once (or a symlinked .trash/): the daemon's start-up scan
    and GC runs go past them, /v1/status reports them, and one SIGTERM stops it (exit 0)."""
    trees = (
        [build(layout, victim, p) for p in (*MANIFEST_POISONS, *ENTRY_POISONS)]
        if poison == "all-ns-poisons"
        else [build(layout, victim, poison)]
    )
    planted = {p: fp for t in trees for p, fp in t.planted.items()}
    lines: list[str] = []
    with _serve(layout, {**GC_ENV, "CACHEMGR_GC_INTERVAL": "1s"}) as proc:
        try:
            url = _url(proc, lines)
            wait_for(lambda: _ready(url), bool, timeout=HANG_SECONDS)
            unbound = trees[0].unbound
            # GC runs (every second) drop the healthy unbound namespace and nothing else.
            if poison == "all-ns-poisons":
                wait_for(lambda: layout.ns_dir(unbound).exists(), lambda e: not e, timeout=20)
            states = {
                n["id"]: n["state"] for n in httpx.get(f"{url}/v1/status").json()["namespaces"]
            }
            for t in trees:
                assert all(states.get(ns) == t.state for ns in t.poison_ids if ns), states
            if poison == "all-ns-poisons":  # a purge over HTTP: the rest goes, poisons reported
                r = httpx.post(f"{url}/v1/purge", json={"all": True}, timeout=HANG_SECONDS)
                assert r.status_code == 200, r.text
                poisoned = {ns for t in trees for ns in t.poison_ids}
                left = {x.split(":")[0].removeprefix("ns/") for x in r.json()["problems"]}
                assert left == poisoned
                assert list(layout.ns_dir(trees[0].bound).glob("*.bin")) == []
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=HANG_SECONDS)
        finally:
            if proc.poll() is None:
                _unblock_fifos(layout.root)
                proc.kill()
                proc.communicate()
    log = "".join(lines) + err
    assert proc.returncode == 0, log
    assert "Traceback" not in log and '"daemon stopped"' in log
    assert {p: _fingerprint(Path(p)) for p in planted} == planted
