"""Namespaces (and a root) the daemon cannot use (issue 26, point 5): a dir another user made
with pages in it, one the daemon cannot read, a root made unreadable while it runs. Each is
quarantined, said in the log, in `cachemgr_namespace_unusable` and by doctor, and the other
namespaces keep their caps; the daemon stays up and recovers when the dir can be used again.

The suite runs as root, where permission bits do not bind. The daemon here runs as a real
process whose capability bounding set lacks CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and
CAP_FOWNER (dropped with prctl before exec): still uid 0, so it can reach the interpreter under
/root, but bound by every mode bit like any other user. The foreign dirs belong to a
throwaway uid.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from tests.daemon_helpers import NS_A, NS_B, page_name, register_namespace, settled, store_page
from tests.polling import wait_for
from tests.reliability.conftest import snapshot
from tests.test_server import metric

OTHER_UID = 54321  # a throwaway user: the owner of the dirs the daemon may not touch
PAGE = 1024
CAP = 100 * PAGE
NS_X = "00000000000000ee"
_DAC_CAPS = (1, 2, 3)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
_PR_CAPBSET_DROP = 24


def _without_dac() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in _DAC_CAPS:
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def capless(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A cachemgr command on `root`, bound by mode bits as the daemon here is."""
    argv = [sys.executable, "-m", "cachemgr", "--root", str(root), *args]
    return subprocess.run(
        argv, capture_output=True, text=True, preexec_fn=_without_dac, timeout=120
    )


class Daemon:
    def __init__(self, proc: subprocess.Popen[str], port: int) -> None:
        self.proc, self.http = proc, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)

    def metric(self, name: str, **labels: str) -> float | None:
        return metric(self.http.get("/metrics").text, name, **labels)

    def alive(self) -> bool:
        return self.proc.poll() is None and self.http.get("/healthz").status_code == 200


CAP_ENV = {"CACHEMGR_GC_NAMESPACE_MAX_BYTES": str(CAP)}


@contextmanager
def daemon(
    root: Path, port: int, log: Path, settings: Mapping[str, str] = CAP_ENV
) -> Iterator[Daemon]:
    """`cachemgr serve` bound by mode bits (see the module doc), with `settings` (environment
    variables: GC keeping a per-namespace cap unless told)."""
    env = {
        **os.environ,
        **settings,
        "CACHEMGR_GC_MIN_AGE": "0",
        "CACHEMGR_BATCH_INTERVAL": "0.05",
        "CACHEMGR_GC_INTERVAL": "1",
    }
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cachemgr",
                "--log-format",
                "json",
                "--root",
                str(root),
                "serve",
                "--port",
                str(port),
                "--reconcile-interval",
                "1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_without_dac,
            text=True,
        )
    d = Daemon(proc, port)
    try:
        wait_for(lambda: _ready(d), bool, timeout=60, what="the daemon ready")
        yield d
    finally:
        d.http.close()
        proc.terminate()
        proc.wait(30)


def _ready(d: Daemon) -> bool:
    if d.proc.poll() is not None:
        raise AssertionError(f"the daemon exited with {d.proc.returncode}")
    try:
        return settled(d.http.get("/readyz"))
    except httpx.TransportError:
        return False


def lines(log: Path, message: str) -> list[dict[str, object]]:
    found = []
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("msg") == message:
            found.append(rec)
    return found


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """A root the capability-less daemon owns (uid 0); pytest's own tmp dirs are 0700."""
    top = tmp_path / "top"
    top.mkdir()
    for p in (tmp_path, top):
        p.chmod(0o755)
    layout = Layout.at(top / "root")
    create_root(layout)
    register_namespace(layout, NS_A, instance="sglang-a")
    return top


def foreign_ns(layout: Layout, ns: str, mode: int, pages: int = 150) -> Path:
    """A namespace whose dir another user made (registered and bound as init would), with
    pages in it."""
    d = register_namespace(layout, ns, instance=f"other-{ns[-2:]}")
    for i in range(pages):
        store_page(d, page_name(i), PAGE)
    for p in [d, *d.iterdir()]:
        os.chown(p, OTHER_UID, OTHER_UID)
    d.chmod(mode)
    return d


def fill(ns_dir: Path, start: int, n: int) -> None:
    for i in range(start, start + n):
        store_page(ns_dir, page_name(i), PAGE)


def held(ns_dir: Path) -> int:
    """The bytes of the pages in `ns_dir` now; GC may delete one between the listing and its
    stat."""
    total = 0
    for p in ns_dir.iterdir():
        with contextlib.suppress(FileNotFoundError):
            total += p.stat().st_size if p.name.endswith(".bin") else 0
    return total


@pytest.mark.parametrize(("mode", "reason"), [(0o755, "not-writable"), (0o700, "unreadable")])
def test_a_namespace_of_another_user_is_quarantined_and_the_others_keep_their_caps(
    base: Path, free_port: int, mode: int, reason: str
) -> None:
    layout = Layout.at(base / "root")
    x = foreign_ns(layout, NS_X, mode)
    x.chmod(0o755)
    before = snapshot(x)
    x.chmod(mode)
    log = base / "daemon.log"
    with daemon(layout.root, free_port, log) as d:
        fill(layout.ns_dir(NS_A), 1000, 300)  # 3x A's cap
        wait_for(lambda: held(layout.ns_dir(NS_A)), lambda n: n <= CAP, timeout=60, what="A's cap")
        wait_for(
            lambda: d.metric("cachemgr_namespace_unusable", namespace=NS_X, reason=reason),
            lambda v: v == 1,
            timeout=30,
            what="X in cachemgr_namespace_unusable",
        )
        assert d.http.post("/v1/gc", json={}).status_code == 200
        assert d.alive()
    assert d.proc.returncode == 0, log.read_text()[-3000:]
    said = lines(log, "namespace unusable; skipped")
    assert said and all(r["namespace"] == NS_X for r in said)
    assert len(said) == 1  # once, not at every cycle or reconcile
    x.chmod(0o755)
    assert snapshot(x) == before  # nothing of the other user's changed
    doctor = subprocess.run(
        [sys.executable, "-m", "cachemgr", "--root", str(layout.root), "doctor"],
        capture_output=True,
        text=True,
        preexec_fn=_without_dac,
        timeout=120,
    )
    x.chmod(mode)
    assert NS_X in doctor.stdout and "cannot" in doctor.stdout, doctor.stdout


def indexed_pages(d: Daemon, ns: str) -> float | None:
    return d.metric("cachemgr_namespace_pages", namespace=ns)


def index_rows(layout: Layout, ns: str) -> int:
    """The page rows the daemon's index holds for `ns` (read beside it: WAL)."""
    conn = sqlite3.connect(f"file:{layout.db_path}?mode=ro", uri=True)
    try:
        (n,) = conn.execute("SELECT count(*) FROM pages WHERE namespace_id = ?", (ns,)).fetchone()
    finally:
        conn.close()
    return int(n)


def test_a_namespace_made_unreadable_mid_run_is_held_aside_until_readable_again(
    base: Path, free_port: int
) -> None:
    layout = Layout.at(base / "root")
    z = register_namespace(layout, NS_B, instance="sglang-b")
    fill(z, 0, 20)
    log = base / "daemon.log"
    with daemon(layout.root, free_port, log) as d:
        wait_for(lambda: indexed_pages(d, NS_B), lambda n: n == 20, timeout=30, what="B indexed")
        z.chmod(0o000)  # the reconcile (every 1 s here) finds it so
        wait_for(
            lambda: d.metric("cachemgr_namespace_unusable", namespace=NS_B, reason="unreadable"),
            lambda v: v == 1,
            timeout=30,
            what="B unusable",
        )
        fill(layout.ns_dir(NS_A), 1000, 300)  # A's cap is kept meanwhile
        wait_for(lambda: held(layout.ns_dir(NS_A)), lambda n: n <= CAP, timeout=60, what="A's cap")
        assert f"namespace {NS_B} unreadable" in d.http.get("/readyz").json()["detail"]
        assert index_rows(layout, NS_B) == 20  # its rows are kept while it cannot be read
        # ...but not shown as its count: its pages may have changed since it was read
        assert indexed_pages(d, NS_B) is None
        z.chmod(0o755)
        fill(z, 20, 5)
        wait_for(
            lambda: indexed_pages(d, NS_B), lambda n: n == 25, timeout=30, what="B indexed again"
        )
        wait_for(
            lambda: d.metric("cachemgr_namespace_unusable", namespace=NS_B, reason="unreadable"),
            lambda v: v is None,
            timeout=30,
            what="B usable again",
        )
        assert d.alive()
    assert d.proc.returncode == 0
    assert len(lines(log, "namespace unusable; skipped")) == 1
    assert len(lines(log, "namespace usable again")) == 1


@pytest.mark.parametrize("which", ["root", "ns"])
def test_a_root_made_unreadable_mid_run_keeps_the_daemon_up_and_it_recovers(
    base: Path, free_port: int, which: str
) -> None:
    layout = Layout.at(base / "root")
    top = layout.root if which == "root" else layout.ns_root
    a = layout.ns_dir(NS_A)
    fill(a, 0, 20)
    log = base / "daemon.log"
    with daemon(layout.root, free_port, log) as d:
        wait_for(lambda: indexed_pages(d, NS_A), lambda n: n == 20, timeout=30, what="A indexed")
        top.chmod(0o000)
        wait_for(
            lambda: d.metric("cachemgr_root_unusable"),
            lambda v: v == 1,
            timeout=30,
            what="the root unusable",
        )
        detail = d.http.get("/readyz").json()["detail"]
        assert "root unreadable" in detail, detail
        deadline = time.monotonic() + 12  # more than two retries and GC floor checks (5 s)
        while time.monotonic() < deadline:
            assert d.alive()
            time.sleep(0.5)
        top.chmod(0o755)
        fill(a, 20, 5)
        wait_for(
            lambda: indexed_pages(d, NS_A), lambda n: n == 25, timeout=30, what="A indexed again"
        )
        wait_for(
            lambda: d.metric("cachemgr_root_unusable"),
            lambda v: v == 0,
            timeout=30,
            what="the root usable again",
        )
        assert d.alive()
    assert d.proc.returncode == 0
    assert len(lines(log, "root unusable; the daemon waits for it")) == 1
    errors = [r for r in map(_json, log.read_text().splitlines()) if r.get("exc")]
    assert errors == []  # no traceback, let alone one every 5 s


def _json(line: str) -> dict[str, object]:
    try:
        rec = json.loads(line)
    except ValueError:
        return {}
    return rec if isinstance(rec, dict) else {}


def test_a_namespace_unusable_for_two_reasons_is_held_for_both(base: Path, free_port: int) -> None:
    """GC found its pages not deletable, then the index found it unreadable: the second
    reason used to replace the first, and clearing it dropped the namespace from the gauge
    while GC still could not delete there."""
    layout = Layout.at(base / "root")
    x = foreign_ns(layout, NS_X, 0o755)
    log = base / "daemon.log"

    def unusable(d: Daemon, reason: str) -> float | None:
        return d.metric("cachemgr_namespace_unusable", namespace=NS_X, reason=reason)

    with daemon(layout.root, free_port, log) as d:
        wait_for(lambda: unusable(d, "not-writable"), _one, timeout=30, what="X not-writable")
        x.chmod(0o000)  # the reconcile (every 1 s here) finds it so
        try:
            wait_for(lambda: unusable(d, "unreadable"), _one, timeout=30, what="X unreadable")
            assert unusable(d, "not-writable") == 1  # still: both are said
            detail = d.http.get("/readyz").json()["detail"]
            assert f"namespace {NS_X} not-writable" in detail, detail
            assert f"namespace {NS_X} unreadable" in detail, detail
            doctor = capless(layout.root, "doctor", "--json")
        finally:
            x.chmod(0o755)
        wait_for(lambda: unusable(d, "unreadable"), _none, timeout=30, what="X readable again")
        assert unusable(d, "not-writable") == 1  # its pages are still not GC's to delete
        assert d.alive()
    assert doctor.stdout, doctor.stderr
    (said,) = [f["message"] for f in json.loads(doctor.stdout) if NS_X in f["message"]]
    assert "cannot be read" in said and "cannot be written" in said, said


def _one(value: float | None) -> bool:
    return value == 1


def _none(value: float | None) -> bool:
    return not value


def test_ls_and_doctor_on_a_namespace_they_cannot_read_say_so(base: Path) -> None:
    """Both stopped at 'Permission denied' on another user's 0700 dir, listing nothing else;
    `ls` lists the rest, and says it in one line and exit 1 (the listing is not whole)."""
    layout = Layout.at(base / "root")
    foreign_ns(layout, NS_X, 0o700, pages=3)
    ls = capless(layout.root, "ls", "--json")
    assert ls.returncode == 1, ls.stderr
    assert ls.stderr.splitlines() == [
        f"cachemgr: warning: namespace {NS_X} cannot be read by uid 0: Permission denied"
    ]
    rows = {n["ns_id"]: n for n in json.loads(ls.stdout)["namespaces"]}
    assert rows[NS_X]["state"] == "unreadable" and NS_A in rows, rows
    doctor = capless(layout.root, "doctor", "--json")
    assert doctor.stderr == "", doctor.stderr
    codes = {f["code"] for f in json.loads(doctor.stdout)}
    assert "ns-unusable" in codes, doctor.stdout


def _replace_ns(layout: Layout, how: str, aside: Path) -> None:
    """Take <root>/ns away (to `aside`) and leave what `how` says in its place."""
    layout.ns_root.rename(aside)
    if how == "symlink":
        layout.ns_root.symlink_to(aside)
    elif how == "file":
        layout.ns_root.write_text("not a dir\n")


@pytest.mark.parametrize("how", ["gone", "symlink", "file"])
def test_a_root_whose_ns_dir_is_removed_or_replaced_is_unusable_until_it_is_back(
    base: Path, free_port: int, how: str
) -> None:
    """A removed or symlinked ns/ left /readyz at 'index live' and cachemgr_root_unusable at
    0 (only a permission error counted), and a symlink failed the metrics refresh with a
    traceback every second. It is held aside as an unreadable root is, and recovers."""
    layout = Layout.at(base / "root")
    a = layout.ns_dir(NS_A)
    fill(a, 0, 20)
    aside = base / "ns-aside"
    log = base / "daemon.log"
    with daemon(layout.root, free_port, log) as d:
        wait_for(lambda: indexed_pages(d, NS_A), lambda n: n == 20, timeout=30, what="A indexed")
        _replace_ns(layout, how, aside)
        wait_for(
            lambda: d.metric("cachemgr_root_unusable"), _one, timeout=30, what="the root unusable"
        )
        detail = d.http.get("/readyz").json()["detail"]
        assert "root unreadable" in detail and str(layout.ns_root) in detail, detail
        doctor = capless(layout.root, "doctor", "--json")
        time.sleep(4)  # a few metrics refreshes (every 1 s) and a retry of the root
        assert d.alive()
        if how != "gone":
            layout.ns_root.unlink()
        aside.rename(layout.ns_root)
        fill(a, 20, 5)
        wait_for(
            lambda: indexed_pages(d, NS_A), lambda n: n == 25, timeout=30, what="A indexed again"
        )
        wait_for(lambda: d.metric("cachemgr_root_unusable"), _zero, timeout=30, what="root usable")
        register_namespace(layout, NS_B, instance="sglang-b")  # the new ns/ dir is watched
        fill(layout.ns_dir(NS_B), 0, 3)
        wait_for(lambda: indexed_pages(d, NS_B), lambda n: n == 3, timeout=30, what="B indexed")
    assert d.proc.returncode == 0
    assert len(lines(log, "root unusable; the daemon waits for it")) == 1
    assert len(lines(log, "root usable again")) == 1
    errors = [r for r in map(_json, log.read_text().splitlines()) if r.get("exc")]
    assert errors == []  # no traceback, let alone one a second
    assert len(lines(log, "metrics refresh failed; the last snapshot stays")) <= 1
    (finding,) = [f for f in json.loads(doctor.stdout) if f["code"] == "root-unusable"]
    assert str(layout.ns_root) in finding["message"], finding
    assert doctor.returncode == 2, doctor.stderr


def _zero(value: float | None) -> bool:
    return value == 0
