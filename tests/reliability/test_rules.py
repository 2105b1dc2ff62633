"""Rules that must hold on every path: min-age on every GC deletion, an audit that matches the
files gone after a kill -9, cachemgr's own temp files swept and reported, one audit row per
purge however many purgers race."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from cachemgr.fs.root import create_root
from cachemgr.gc.execute import CHUNK, execute_gc
from cachemgr.gc.plan import plan_gc
from cachemgr.gc.policy import GcPolicy
from cachemgr.gc.runner import GcRunner
from cachemgr.gc.step import GcReport
from cachemgr.layout import Layout
from cachemgr.ns.registry import ensure_namespace
from cachemgr.ns.runcontext import RunContext
from cachemgr.settings import load_settings
from cachemgr.state.index import scan_root
from cachemgr.state.store import Store
from tests.daemon_helpers import (
    NS_A,
    NS_B,
    cli_argv,
    page_name,
    register_namespace,
    running_daemon,
    wait_for,
)
from tests.nsfixtures import cli

OLD = time.time() - 30 * 86400


def _root(tmp_path: Path) -> tuple[Layout, Store]:
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    return layout, Store.open(layout.db_path)


def _unbound_ns(layout: Layout, store: Store, ns: str, pages: int, mtime: float) -> Path:
    """An unbound namespace idle for a month, its pages indexed with `mtime`."""
    ensure_namespace(layout, store, ns_id=ns, digest=ns * 2, identity={"m": ns}, now=OLD)
    d = layout.ns_dir(ns)
    for i in range(pages):
        (d / page_name(i)).write_bytes(b"\x01" * 100)
        os.utime(d / page_name(i), (mtime, mtime))
    scan_root(layout, store)
    return d


def _rewrite(d: Path, names: list[str], mtime: float) -> None:
    """Pages written again (a server still writing, the index lagging): only mtimes change."""
    for name in names:
        os.utime(d / name, (mtime, mtime))


def _audit(store: Store, action: str) -> list[tuple[str | None, str, int]]:
    rows = store.conn.execute(
        "SELECT namespace_id, reason, pages FROM audit WHERE action = ? ORDER BY id", (action,)
    )
    return [tuple(r) for r in rows]  # type: ignore[misc]


def _state(store: Store, ns: str) -> str:
    return str(store.conn.execute("SELECT state FROM namespaces WHERE id = ?", (ns,)).fetchone()[0])


# --- min-age on every deletion path -----------------------------------------------------------


def _gc(layout: Layout, store: Store, policy: GcPolicy) -> GcReport:
    """One real GC run, as `cachemgr gc` does it; the GC lock is released afterwards."""
    runner = GcRunner(layout, store, policy)
    try:
        return runner.run(actor="cli")
    finally:
        runner.leadership.release()


def test_gc_leaves_an_unbound_namespace_with_young_pages_in_place(tmp_path: Path) -> None:
    """The reported case: 50 pages 8 s old, min_age 20 s, an unbound namespace past retention
    whose index says it is idle: the real runner must not drop it."""
    layout, store = _root(tmp_path)
    d = _unbound_ns(layout, store, NS_A, 50, OLD)
    _rewrite(d, [page_name(i) for i in range(50)], time.time() - 8)
    report = _gc(
        layout, store, GcPolicy(min_age=20, keep_unbound=0, unbound_ttl=None, delete_rate=None)
    )
    assert report.files == 0
    assert len(os.listdir(d)) == 50 and layout.manifest(NS_A).is_file()
    assert _state(store, NS_A) == "active" and _audit(store, "evict") == []
    assert os.listdir(layout.trash) == []


def test_a_drop_planned_before_pages_turned_young_is_deferred_whole(tmp_path: Path) -> None:
    """Pages written between plan and execution: the drop is re-checked under the root lock and
    deferred, the namespace left as it was (dir, manifest, registry, index rows)."""
    layout, store = _root(tmp_path)
    d = _unbound_ns(layout, store, NS_A, 100, OLD)
    pol = GcPolicy(min_age=20, keep_unbound=0, unbound_ttl=None, delete_rate=None)
    plan = plan_gc(layout, store, pol, now=time.time())
    assert [s.reason for s in plan.steps] == ["unbound"]
    _rewrite(d, [page_name(i) for i in range(50)], time.time() - 8)
    report = execute_gc(plan, RunContext(layout, store))
    (step,) = report.steps
    assert step.files == 0 and step.young == 50 and step.skipped and "min_age" in step.skipped
    assert len(os.listdir(d)) == 100 and layout.manifest(NS_A).is_file()
    assert _state(store, NS_A) == "active" and _audit(store, "evict") == []
    assert os.listdir(layout.trash) == []
    (rows,) = store.conn.execute("SELECT COUNT(*) FROM pages WHERE namespace_id = ?", (NS_A,))
    assert rows[0] == 100
    # Once they are old enough the same namespace goes, audited once with what it held.
    _rewrite(d, [page_name(i) for i in range(50)], time.time() - 30)
    assert _gc(layout, store, pol).files == 100
    assert not d.exists() and _audit(store, "evict") == [(NS_A, "unbound", 100)]


def test_stale_temps_wait_for_min_age_even_with_a_shorter_tmp_ttl(tmp_path: Path) -> None:
    layout, store = _root(tmp_path)
    d = register_namespace(layout, NS_A, instance="gpu0")
    young, old = d / f".{1:032x}.tmp", d / f".{2:032x}.tmp"
    for path, mtime in ((young, time.time() - 8), (old, OLD)):
        path.write_bytes(b"t")
        os.utime(path, (mtime, mtime))
    assert _gc(layout, store, GcPolicy(min_age=20, tmp_ttl=1, delete_rate=None)).files == 1
    assert young.exists() and not old.exists()


# --- the audit after a kill -9 -----------------------------------------------------------------


def test_a_gc_killed_mid_eviction_audited_exactly_what_it_evicted(tmp_path: Path) -> None:
    """`cachemgr gc --yes` evicting 3000 pages at 1000/s, SIGKILLed mid-run: the audit counts
    every page file gone (but the in-flight chunk), and exactly the index rows it removed."""
    layout, store = _root(tmp_path)
    d = layout.ns_root / NS_A
    d.mkdir()
    total = 3000
    for i in range(total):
        (d / page_name(i)).write_bytes(b"\x01" * 100)
        os.utime(d / page_name(i), (OLD + i, OLD + i))
    store.close()
    proc = subprocess.Popen(
        [
            *cli_argv(layout.root),
            "gc",
            "--yes",
            "--max-bytes",
            "1",
            "--min-age",
            "0",
            "--delete-rate",
            "1000",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(lambda: len(os.listdir(d)), lambda n: n <= total - 1200, timeout=30, every=0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=10)
    gone = total - len(os.listdir(d))
    assert 0 < gone < total, f"the kill must land mid-run: {err}"
    conn = sqlite3.connect(layout.db_path)
    try:
        (audited,) = conn.execute("SELECT COALESCE(SUM(pages), 0) FROM audit").fetchone()
        (rows,) = conn.execute("SELECT COUNT(*) FROM pages").fetchone()
    finally:
        conn.close()
    assert rows + audited == total  # rows and their audit leave in one transaction
    assert 0 <= gone - audited <= CHUNK, (gone, audited)


# --- cachemgr's own temp files -------------------------------------------------------------------


def _killed_at_rename(layout: Layout, name: str) -> Path:
    """Write ns/<name> as a manifest is written, in a process SIGKILLed at the rename: the
    temp file it leaves behind."""
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from cachemgr.fs.safe import open_dir, write_atomic_at\n"
        "os.rename = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
        "with open_dir(Path(sys.argv[1]), 'ns') as fd:\n"
        "    write_atomic_at(fd, sys.argv[2], b'{}')\n"
    )
    run = subprocess.run([sys.executable, "-c", code, str(layout.root), name], timeout=60)
    assert run.returncode == -signal.SIGKILL
    (left,) = layout.ns_root.glob(f".{name}.*.tmp-cachemgr")
    return left


def test_own_temps_left_by_a_killed_write_are_reported_and_swept(
    tmp_path: Path, victim: Path
) -> None:
    """`init` killed between writing `.<id>.json.<hex>.tmp-cachemgr` and its rename: doctor
    reports it, gc removes it past tmp_ttl; look-alikes that are not ours, not regular files,
    or young stay."""
    layout, store = _root(tmp_path)
    store.close()
    ns = layout.ns_root
    left = _killed_at_rename(layout, f"{NS_A}.json")
    at_root = layout.root / ".CACHEDIR.TAG.ba9876543210.tmp-cachemgr"
    young = ns / f".{NS_B}.json.aaaaaaaaaaaa.tmp-cachemgr"
    not_ours = ns / f".{NS_A}.json.tmp"
    look_alike = ns / ".notes.tmp-cachemgr"  # not write_atomic_at's shape: no 12 hex digits
    link = ns / f".{NS_B}.json.bbbbbbbbbbbb.tmp-cachemgr"
    a_dir = ns / f".{NS_B}.json.cccccccccccc.tmp-cachemgr"
    os.utime(left, (OLD, OLD))
    for path in (at_root, young, not_ours, look_alike):
        path.write_text("{}")
        os.utime(path, (OLD, OLD) if path is not young else None)
    link.symlink_to(victim / "precious.txt")
    os.utime(link, (OLD, OLD), follow_symlinks=False)
    a_dir.mkdir()
    os.utime(a_dir, (OLD, OLD))

    out = cli("--root", str(layout.root), "doctor")
    assert out.returncode == 1, out.stdout + out.stderr
    reported = [ln for ln in out.stdout.splitlines() if "own-temp" in ln]
    # the young one too: doctor cannot tell a write in progress, GC can (tmp_ttl)
    assert len(reported) == 3 and any(str(left) in ln for ln in reported), out.stdout
    assert any(str(at_root) in ln for ln in reported)

    dry = cli("--root", str(layout.root), "gc", "--dry-run", "--tmp-ttl", "1h", "--min-age", "0")
    assert dry.returncode == 0 and "tmp" in dry.stdout and left.exists(), dry.stdout + dry.stderr
    out = cli("--root", str(layout.root), "gc", "--yes", "--tmp-ttl", "1h", "--min-age", "0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert not left.exists() and not at_root.exists()
    assert young.exists() and not_ours.exists() and look_alike.exists()
    assert link.is_symlink() and a_dir.is_dir()
    after = cli("--root", str(layout.root), "doctor").stdout
    assert [ln for ln in after.splitlines() if "own-temp" in ln and str(young) in ln] == [
        ln for ln in after.splitlines() if "own-temp" in ln
    ]


# --- concurrent purges ---------------------------------------------------------------------------


def _purge_cli(root: Path, *selector: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            *cli_argv(root),
            "purge",
            *selector,
            "--yes",
            "--no-wait",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _race(
    url: str, root: Path, selector: tuple[str, str]
) -> tuple[list[str], list[httpx.Response]]:
    """Four CLI purges started at once, and four HTTP clients purging the same thing over and
    over until the last CLI is done: (each CLI's stdout, every HTTP answer)."""
    flag, value = selector
    body = {flag.removeprefix("--"): value}
    done = threading.Event()
    answers: list[httpx.Response] = []

    def post() -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            while True:
                answers.append(http.post("/v1/purge", json=body))
                if done.is_set():
                    return

    threads = [threading.Thread(target=post) for _ in range(4)]
    procs = [_purge_cli(root, flag, value) for _ in range(4)]
    for t in threads:
        t.start()
    outs = [p.communicate(timeout=60) for p in procs]
    done.set()
    for t in threads:
        t.join(60)
    for p, (_, err) in zip(procs, outs, strict=True):
        # a purge that found the namespace gone already says so in one line
        assert p.returncode == 0 or "no namespace" in err, err
        assert "Traceback" not in err, err
    return [o for o, _ in outs], answers


def test_racing_cli_and_http_purges_audit_one_purge(tmp_path: Path) -> None:
    """CLI processes and HTTP requests purge the same bound instance (then the same unbound
    namespace) at once: one `purge` row each with the real page count, every other purge
    purges nothing, and the bound instance keeps its dir."""
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    bound = register_namespace(layout, NS_A, instance="gpu0")
    unbound = register_namespace(layout, NS_B)
    for d, n in ((bound, 40), (unbound, 25)):
        for i in range(n):
            (d / page_name(i)).write_bytes(b"\x01" * 100)
    with running_daemon(load_settings(root=layout.root, gc_interval=3600)) as dm:
        for selector in (("--instance", "gpu0"), ("--namespace", NS_B)):
            outs, answers = _race(dm.url, layout.root, selector)
            assert all(a.status_code in (200, 404) for a in answers), [a.text for a in answers]
            http_did = [a.json() for a in answers if a.status_code == 200 and a.json()["purged"]]
            cli_did = [o for o in outs if "purged ns" in o]
            assert len(http_did) + len(cli_did) == 1, (http_did, cli_did)
            assert bound.is_dir()
    store = Store.open(layout.db_path)
    try:
        assert sorted(_audit(store, "purge")) == [(NS_A, "manual", 40), (NS_B, "manual", 25)]
    finally:
        store.close()
    assert bound.is_dir() and not unbound.exists()
