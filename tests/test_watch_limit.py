"""The kernel's inotify watch limit reached (fs.inotify.max_user_watches: other watchers on the
node, or a vLLM tree of a million dirs): the real daemon, in a user namespace whose own limit
(/proc/sys/user/max_inotify_watches) is a few watches, still indexes every page, keeps the
dirs without a watch up to date by its reconcile scans, and says so: /v1/status, the metric,
doctor, and one log line, not one a dir."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachemgr.daemon import nestwatch
from cachemgr.daemon.events import Kind
from cachemgr.daemon.watcher import Watcher
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.state.store import Store
from tests.daemon_helpers import NS_A, NS_B, page_name, register_namespace, store_page
from tests.fleet_bed import free_port
from tests.polling import wait_for
from tests.vllmtrees import vllm_tree, write_blocks

NS_C = "aabbccddeeff0011"
userns = pytest.mark.skipif(
    shutil.which("unshare") is None
    or shutil.which("nsenter") is None
    or subprocess.run(["unshare", "-Ur", "true"], capture_output=True).returncode != 0,
    reason="needs user namespaces (unshare -Ur): each has its own inotify watch limit",
)


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    lay = Layout.at(tmp_path / "root")
    create_root(lay)
    return lay


class Limited:
    """`cachemgr serve` with `watches` inotify watches to use, on a loopback port."""

    def __init__(self, layout: Layout, watches: int, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        serve = [sys.executable, "-m", "cachemgr", "--root", str(layout.root), "serve"]
        script = f'echo {watches} > /proc/sys/user/max_inotify_watches && exec "$@"'
        env = {
            **os.environ,
            "CACHEMGR_LOG_FORMAT": "json",
            "CACHEMGR_RECONCILE_INTERVAL": "2",
            "CACHEMGR_GC_INTERVAL": "1h",
        }
        with log.open("wb") as err:
            self.proc = subprocess.Popen(
                ["unshare", "-Ur", "sh", "-c", script, "sh", *serve, "--port", str(self.port)],
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=env,
            )
        wait_for(self._ready, timeout=60, what="the daemon ready")

    def _ready(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            return httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def status(self) -> dict[str, Any]:
        got: dict[str, Any] = httpx.get(f"{self.url}/v1/status", timeout=10).json()
        return got

    def pages(self, ns: str) -> int | None:
        (got,) = [n["pages"] for n in self.status()["namespaces"] if n["id"] == ns]
        return int(got) if got is not None else None

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        match = re.search(rf"^{name} (\S+)$", text, re.M)
        assert match, text
        return float(match.group(1))

    def allow(self, watches: int) -> None:
        """Raise the user namespace's watch limit, from inside it."""
        limit = "/proc/sys/user/max_inotify_watches"
        script = f"echo {watches} > {limit}"
        subprocess.run(["nsenter", "-U", "-t", str(self.proc.pid), "sh", "-c", script], check=True)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[list[Limited]]:
    running: list[Limited] = []
    yield running
    for d in running:
        d.stop()


def refusals_logged(log: Path) -> int:
    return log.read_text().count("inotify watch limit reached")


@userns
def test_a_namespace_refused_its_watch_is_indexed_and_kept_by_the_reconcile_scans(
    layout: Layout, tmp_path: Path, daemons: list[Limited]
) -> None:
    """<root>/ns takes the one watch: both namespaces' own dirs are refused theirs. Before,
    such a namespace was never scanned: its pages were not indexed, nor counted, nor GC's."""
    a, b = register_namespace(layout, NS_A), register_namespace(layout, NS_B)
    for i in range(30):
        store_page(a, page_name(i))
        store_page(b, page_name(i))
    d = Limited(layout, 1, tmp_path / "serve.log")
    daemons.append(d)
    assert (d.pages(NS_A), d.pages(NS_B)) == (30, 30)
    index = d.status()["index"]
    assert index["watches_refused"] >= 2 and index["watch_refused_at"] is not None
    assert index["watch_refused_namespaces"] == 2
    assert d.metric("cachemgr_watches_refused_total") >= 2
    assert d.metric("cachemgr_watch_refused_namespaces") == 2
    for i in range(30, 40):  # no event for these: the next reconcile scan (2 s) finds them
        store_page(a, page_name(i))
    wait_for(lambda: d.pages(NS_A), lambda n: n == 40, timeout=30, what="the reconcile scan")
    assert d.metric("cachemgr_watches_refused_total") > index["watches_refused"]  # retried
    assert refusals_logged(d.log) == 1  # not one line a dir, nor one a retry

    code, findings = doctor(layout, d)
    assert code == 2, findings
    (found,) = [f for f in findings if f["code"] == "inotify-watch-limit"]
    assert found["severity"] == "error" and "max_user_watches" in found["fix"]

    d.allow(100)  # the limit raised: the next reconcile watches them, no restart
    wait_for(lambda: d.metric("cachemgr_watch_refused_namespaces"), lambda n: n == 0, timeout=30)
    refused = d.metric("cachemgr_watches_refused_total")
    store_page(b, page_name(50))  # seen by its watch now
    wait_for(lambda: d.pages(NS_B), lambda n: n == 31, timeout=30, what="the store")
    assert d.metric("cachemgr_watches_refused_total") == refused


def doctor(layout: Layout, d: Limited) -> tuple[int, list[dict[str, str]]]:
    """`cachemgr doctor --json` asking the daemon `d`: its exit code and findings."""
    doc = subprocess.run(
        [sys.executable, "-m", "cachemgr", "--root", str(layout.root), "doctor", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "CACHEMGR_PORT": str(d.port)},
        timeout=120,
    )
    assert doc.returncode in (0, 1, 2), doc.stdout + doc.stderr
    return doc.returncode, json.loads(doc.stdout)


@userns
def test_a_root_refused_its_own_watch_is_said_with_no_namespace_short(
    layout: Layout, tmp_path: Path, daemons: list[Limited]
) -> None:
    """<root>/ns refused its watch and no namespace yet: the namespaces' gauge stays 0, and it
    was all the alert and doctor read, so only a counter said that new namespaces would be
    found late. The root's own gauge, /v1/status field and doctor's finding say it now, until
    the root is watched."""
    d = Limited(layout, 0, tmp_path / "serve.log")
    daemons.append(d)
    index = d.status()["index"]
    assert index["watch_root_refused"] is True and index["watch_refused_namespaces"] == 0
    assert d.metric("cachemgr_watch_root_refused") == 1
    code, findings = doctor(layout, d)
    assert code == 2, findings
    (found,) = [f for f in findings if f["code"] == "inotify-watch-limit"]
    assert "<root>/ns has no inotify watch" in found["message"], found

    d.allow(100)  # the next reconcile (2 s) watches the root
    wait_for(lambda: d.metric("cachemgr_watch_root_refused"), lambda n: n == 0, timeout=30)
    assert d.status()["index"]["watch_root_refused"] is False
    code, findings = doctor(layout, d)
    assert "inotify-watch-limit" not in [f["code"] for f in findings], findings


@userns
def test_a_daemon_left_no_watch_at_all_starts_and_keeps_the_index_by_its_scans(
    layout: Layout, tmp_path: Path, daemons: list[Limited]
) -> None:
    """Another program took every inotify watch of the user, so <root>/ns is refused its own.
    The index writer failed at once ("inotify watch limit reached") and the daemon never got
    ready; now it serves, indexes by its scans, says so, and watches once it may."""
    a = register_namespace(layout, NS_A)
    for i in range(20):
        store_page(a, page_name(i))
    d = Limited(layout, 0, tmp_path / "serve.log")
    daemons.append(d)
    assert d.pages(NS_A) == 20
    assert d.status()["index"]["watches_refused"] >= 2  # <root>/ns's and A's
    assert refusals_logged(d.log) == 1

    def writes(ns: str) -> int | None:
        got = [n["page_writes"] for n in d.status()["namespaces"] if n["id"] == ns]
        return got[0] if got else None

    b = register_namespace(layout, NS_B)  # no event for the new dir: a reconcile finds it
    for i in range(5):
        store_page(b, page_name(i))
    wait_for(lambda: d.pages(NS_B) if writes(NS_B) is not None else None, lambda n: n == 5)
    assert writes(NS_B) == 0  # found by a listing, not seen stored

    d.allow(100)  # the next reconcile watches <root>/ns: a dir made then is watched at once
    wait_for(lambda: d.metric("cachemgr_watch_refused_namespaces"), lambda n: n == 0, timeout=30)
    c = register_namespace(layout, NS_C)
    for i in range(5):
        store_page(c, page_name(i))
    wait_for(lambda: writes(NS_C), lambda n: n == 5, timeout=30, what="C's stores seen")


@userns
def test_a_vllm_tree_past_the_limit_is_indexed_whole_and_its_dirs_watched_once_freed(
    layout: Layout, tmp_path: Path, daemons: list[Limited]
) -> None:
    """vLLM's tree needs a watch a dir: 12 are not enough for 40 blocks' dirs. Every block is
    indexed all the same; once the limit is lifted, the reconcile watches the rest."""
    with Store.open(layout.db_path) as store:
        ns, d_ns, folder = vllm_tree(layout, store)
    write_blocks(d_ns, folder, 40)
    d = Limited(layout, 12, tmp_path / "serve.log")
    daemons.append(d)
    assert d.pages(ns) == 40
    refused = d.status()["index"]["watches_refused"]
    assert refused > 0
    wait_for(lambda: d.metric("cachemgr_watches_refused_total"), lambda n: n > refused, timeout=30)
    assert refusals_logged(d.log) == 1
    write_blocks(d_ns, folder, 10, start=100)  # in dirs without a watch: found by a reconcile
    wait_for(lambda: d.pages(ns), lambda n: n == 50, timeout=30, what="the reconcile scan")
    assert d.metric("cachemgr_watch_refused_namespaces") == 1
    d.allow(1000)
    wait_for(lambda: d.metric("cachemgr_watch_refused_namespaces"), lambda n: n == 0, timeout=30)


def no_watch_left(*args: object) -> int:
    """inotify_add_watch past the user's limit, as watchdog raises it."""
    raise OSError(errno.ENOSPC, "no watch left")


def test_a_namespace_gone_after_its_watch_was_refused_is_not_scanned(layout: Layout) -> None:
    """A refused namespace dir removed before its NS_GONE is applied: gone, not refused (a scan
    of the absent dir would drop its rows with no audit of what took them)."""
    d = register_namespace(layout, NS_A)
    w = Watcher(layout)
    w.start()
    try:
        assert w._fd is not None
        real = w._fd.add_callback
        w._fd.add_callback = no_watch_left  # type: ignore[method-assign]
        assert not w.watch(NS_A) and w.refused(NS_A)
        assert w.gaps.short == 1
        w._fd.add_callback = real  # type: ignore[method-assign]
        shutil.rmtree(d)
        assert not w.watch(NS_A) and not w.refused(NS_A)
        assert w.gaps.short == 0
    finally:
        w.stop()


def test_a_tree_dir_swapped_for_a_link_is_never_watched_through(
    layout: Layout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rank dir replaced by a symlink to dirs elsewhere after it was listed: its hashed
    dirs are watched through the descriptors opened from the listed dir, never by a path that
    now leads out of the namespace."""
    with Store.open(layout.db_path) as store:
        ns, d, folder = vllm_tree(layout, store)
    write_blocks(d, folder, 40, size=1)
    rank = d / f"{folder}_r0"
    hashed = sorted(os.listdir(rank))
    foreign = tmp_path / "foreign"
    for h in hashed:
        (foreign / h).mkdir(parents=True)
    real = nestwatch._own_dir
    swapped: list[bool] = []

    def own_dir(dir_fd: int, name: str) -> int:
        if name in hashed and not swapped:  # the rank dir listed: swap it now
            os.rename(rank, d / "moved")
            os.symlink(foreign, rank)
            swapped.append(True)
        return real(dir_fd, name)

    monkeypatch.setattr(nestwatch, "_own_dir", own_dir)
    w = Watcher(layout)
    w.start()
    try:
        assert w.watch(ns) and swapped
        assert w._fd is not None
        info = Path(f"/proc/self/fdinfo/{w._fd._inotify_fd}").read_text()
        watched = {int(i, 16) for i in re.findall(r"^inotify wd:\S+ ino:([0-9a-f]+)", info, re.M)}
        outside = {os.stat(foreign / h).st_ino for h in hashed}
        assert not watched & outside  # (those it watched inside went with the move)
    finally:
        w.stop()


def test_a_root_replaced_while_no_watch_is_left_is_asked_again(layout: Layout) -> None:
    """ns/ moved away and made again while the user has no watch left: the old watch (on the
    dir moved away) goes, and the reconcile asks for the new one until it comes. Before, the
    old watch stayed: the root looked watched and was never asked for again, and the events of
    the dir moved away were taken for the root's."""
    w = Watcher(layout)
    w.start()
    try:
        assert w._fd is not None and not w.root_refused()
        real = w._fd.add_callback
        os.rename(layout.ns_root, layout.root / "ns-old")
        layout.ns_root.mkdir()
        w._fd.add_callback = no_watch_left  # type: ignore[method-assign]
        w.watch_root()
        assert w.root_refused() and w.gaps.refused == 1
        (layout.root / "ns-old" / NS_B).mkdir()  # not the root's any more: no event
        w._fd.add_callback = real  # type: ignore[method-assign]
        w.watch_root()
        assert not w.root_refused()
        (layout.ns_root / NS_A).mkdir()  # the new ns/'s, after NS_B's in kernel order
        wait_for(lambda: [e[1] for e in w.queue if e[0] is Kind.NS_ADDED], lambda n: NS_A in n)
        assert NS_B not in [e[1] for e in w.queue]
    finally:
        w.stop()
