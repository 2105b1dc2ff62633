"""Mount points are the edge of the root: a dir outside it (a *victim* holding files named as
SGLang's pages or vLLM's blocks) bind-mounted at a namespace dir, a trash entry, a vLLM folder,
a rank dir or a hashed dir keeps every byte under `gc`, `purge`, the daemon's GC and the
free-space floor pass. A bind mount of a dir on the same filesystem has the root's st_dev: only
the mount id tells it.

Real `mount --bind` (CI runs as root): a test that cannot mount fails, it does not skip. Every
mount is undone in the fixture's teardown, whatever the test did (a purge moves a mount point).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cachemgr.fs.deletion import PART, Listeners, delete_files
from cachemgr.fs.root import create_root
from cachemgr.gc.execute import execute_gc
from cachemgr.gc.floor import free_floor
from cachemgr.gc.plan import plan_gc
from cachemgr.gc.policy import GcPolicy
from cachemgr.layout import Layout
from cachemgr.ns.registry import damaged
from cachemgr.ns.runcontext import RunContext
from cachemgr.settings import Settings
from cachemgr.state.index import scan_root
from cachemgr.state.store import Store
from tests.daemon_helpers import running_daemon
from tests.nsfixtures import cli_process, make_ns
from tests.polling import wait_for
from tests.reliability.conftest import snapshot
from tests.vllmtrees import key, vllm_namespace, write_blocks, write_folder

OLD = 1_000_000_000.0  # every file's mtime: no min-age keeps anything
Bind = Callable[[Path, Path], None]


def _mounts_below(top: Path) -> list[str]:
    points = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    return [p for p in points if p == str(top) or p.startswith(f"{top}/")]


@pytest.fixture
def bind(tmp_path: Path) -> Iterator[Bind]:
    """bind(source, at): `mount --bind source at`; every mount below tmp_path is undone at the
    end, deepest first, wherever a purge moved it. Failing to mount fails the test."""

    def mount(source: Path, at: Path) -> None:
        at.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "--bind", str(source), str(at)], capture_output=True)
        assert done.returncode == 0, f"cannot bind-mount (CI runs as root): {done.stderr!r}"

    try:
        yield mount
    finally:
        for point in sorted(_mounts_below(tmp_path), key=len, reverse=True):
            subprocess.run(["umount", "-l", point], check=False)
        assert not _mounts_below(tmp_path), "a bind mount was left behind"


def _old(paths: list[Path]) -> None:
    for p in paths:
        os.utime(p, (OLD, OLD))


def sglang_victim(base: Path) -> Path:
    """A dir outside the root with three SGLang-named pages and a temp, all old."""
    base.mkdir(parents=True)
    files = [base / f"{i:064x}_mfoo_0_1.bin" for i in range(3)] + [base / f".{'ab' * 16}.tmp"]
    for i, p in enumerate(files):
        p.write_bytes(bytes([i + 1]) * 100)
    _old(files)
    return base


def vllm_victim(base: Path, what: str) -> Path:
    """A dir outside the root shaped like a vLLM namespace dir ("ns"), its identity folder
    ("folder"), a rank dir ("rank") or a hashed dir ("hashed"), with 10 old blocks."""
    tree = base.with_name(base.name + "-tree")
    tree.mkdir(parents=True)
    folder = write_folder(tree)
    blocks = write_blocks(tree, folder, 10, size=100, mtime=OLD, start=500)
    top = {
        "ns": tree,
        "folder": tree / folder,
        "rank": tree / f"{folder}_r0",
        "hashed": tree / blocks[0].rpartition("/")[0].rpartition("/")[0],
    }[what]
    top.rename(base)
    if what == "ns":
        return base
    # the rest of the tree is not the victim's: drop it (rmtree is fine: it is ours)
    subprocess.run(["rm", "-rf", str(tree)], check=True)
    return base


class Root:
    """A root with an SGLang namespace, a vLLM namespace (folder, 4 blocks) and a trash entry
    holding one page; victims are mounted over parts of it."""

    def __init__(self, top: Path) -> None:
        self.layout = Layout.at(top / "root")
        create_root(self.layout)
        with Store.open(self.layout.db_path) as store:
            self.sg = make_ns(self.layout, store, "sg", pages=3)
            self.vl = vllm_namespace(self.layout, store)
        _old(list(self.layout.ns_dir(self.sg).iterdir()))
        self.vdir = self.layout.ns_dir(self.vl)
        self.folder = write_folder(self.vdir)
        self.blocks = write_blocks(self.vdir, self.folder, 4, size=100, mtime=OLD)
        self.entry = self.layout.trash / f"{self.sg[:-1]}0.abc"
        self.entry.mkdir()
        (self.entry / f"{7:064x}_sg_0_1.bin").write_bytes(b"t" * 100)

    def site(self, where: str) -> Path:
        """The dir a victim is mounted at."""
        k = key(0)
        return {
            "sglang-ns": self.layout.ns_dir(self.sg),
            "vllm-ns": self.vdir,
            "trash-entry": self.entry,
            "vllm-folder": self.vdir / self.folder,
            "rank-dir": self.vdir / f"{self.folder}_r0",
            "hashed-dir": self.vdir / f"{self.folder}_r0" / k[:3],
        }[where]


SITES = ["sglang-ns", "vllm-ns", "trash-entry", "vllm-folder", "rank-dir", "hashed-dir"]


def victim_for(where: str, base: Path) -> Path:
    if where in ("sglang-ns", "trash-entry"):
        return sglang_victim(base)
    shape = {"vllm-ns": "ns", "vllm-folder": "folder", "rank-dir": "rank", "hashed-dir": "hashed"}
    return vllm_victim(base, shape[where])


@dataclass(frozen=True)
class Mounted:
    """A root with a victim mounted at one site, and the victim's bytes before."""

    root: Root
    where: str
    victim: Path
    before: dict[str, tuple[int, int, str]]

    def unchanged(self) -> None:
        assert snapshot(self.victim) == self.before, f"a victim mounted at {self.where} changed"


@pytest.fixture(params=SITES)
def site(request: pytest.FixtureRequest, tmp_path: Path, bind: Bind) -> Mounted:
    root = Root(tmp_path)
    victim = victim_for(request.param, tmp_path / "victim")
    before = snapshot(victim)
    bind(victim, root.site(request.param))
    return Mounted(root, request.param, victim, before)


def run(root: Root, *args: str) -> subprocess.CompletedProcess[str]:
    out = cli_process("--root", str(root.layout.root), *args)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
    return out


def test_gc_never_deletes_through_a_bind_mount(site: Mounted) -> None:
    root = site.root
    dry = json.loads(run(root, "gc", "--dry-run", "--json", "--max-bytes", "1").stdout)
    real = json.loads(run(root, "gc", "--yes", "--json", "--max-bytes", "1").stdout)
    site.unchanged()
    assert dry["files"] == real["files"], (dry, real)
    if site.where.endswith("-ns"):  # left alone and said so
        assert any("another mount" in w for w in real["warnings"]), real


def test_purge_never_deletes_through_a_bind_mount(site: Mounted) -> None:
    root = site.root
    out = cli_process("--root", str(root.layout.root), "purge", "--all", "--yes", "--json")
    assert "Traceback" not in out.stderr, out.stderr
    site.unchanged()


def test_the_floor_pass_never_deletes_through_a_bind_mount(site: Mounted) -> None:
    root = site.root
    full = GcPolicy(min_free_bytes=1 << 40)  # a floor no disk meets: everything must go
    report = free_floor(root.layout, full, disk_usage=lambda _: (1 << 30, 1 << 30, 0))
    site.unchanged()
    assert report.files > 0  # the rest of the root was freed
    if site.where.endswith("-ns"):
        assert any("another mount" in w for w in report.warnings), report.warnings


def test_a_namespace_on_another_mount_is_left_alone_and_reported(
    tmp_path: Path, bind: Bind
) -> None:
    root = Root(tmp_path)
    bind(sglang_victim(tmp_path / "victim"), root.site("sglang-ns"))
    bind(sglang_victim(tmp_path / "victim-2"), root.site("trash-entry"))
    state, why = damaged(root.layout)[root.sg]
    assert state == "unsafe" and "another mount" in why, why
    doctor = cli_process("--root", str(root.layout.root), "doctor", "--json")
    codes = {f["code"]: f["message"] for f in json.loads(doctor.stdout)}
    assert "another mount" in codes["ns-unsafe"], codes
    assert "another mount" in codes["trash-unsafe"], codes
    ls = json.loads(run(root, "ls", "--json").stdout)
    (row,) = [n for n in ls["namespaces"] if n["ns_id"] == root.sg]
    # not entered, so not counted (null, not 0): no victim page is counted as ours
    assert row["state"] == "unsafe" and row["pages"] is None, row


def test_the_daemons_gc_never_deletes_through_a_bind_mount(site: Mounted) -> None:
    """The daemon's GC with a cap of one byte: the rest of the root is collected, and no
    victim byte changes."""
    root = site.root
    settings = Settings(root=root.layout.root, gc_max_bytes=1, gc_interval=0.5, gc_min_age=0)
    with running_daemon(settings) as dm:
        wait_for(
            lambda: dm.namespaces(),
            # the victim's namespace is not entered, so not counted (null): no page of it
            lambda ns: all(
                n["pages"] == (None if n["state"] == "unsafe" else 0) for n in ns.values()
            ),
            timeout=60,
            what="GC to collect the root's pages",
        )
        time.sleep(1.5)  # a few more cycles: none may reach a victim
    site.unchanged()


def test_a_mount_put_over_a_namespace_dir_mid_deletion_stops_it(tmp_path: Path, bind: Bind) -> None:
    """Checked before every part of names, not only at the start: a victim mounted over the dir
    after the first part has gone is never reached through it."""
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    with Store.open(layout.db_path) as store:
        ns = make_ns(layout, store, "sg", pages=0)
    d = layout.ns_dir(ns)
    names = [f"{i:064x}_mfoo_0_1.bin" for i in range(3 * PART)]
    for n in names:
        (d / n).write_bytes(b"p")
    victim = tmp_path / "victim"
    victim.mkdir()
    for n in names:  # the very names still to delete
        (victim / n).write_bytes(b"v")
    before = snapshot(victim)
    heard: list[str] = []

    def removed(name: str, _size: int | None) -> None:
        heard.append(name)
        if len(heard) == 1:
            bind(victim, d)

    got = delete_files(layout.root, f"ns/{ns}", names, listeners=Listeners(removed=removed))
    assert snapshot(victim) == before
    assert got.files == PART and "stopped" in got.refused[-1], got


def test_a_mount_appearing_mid_run_is_in_the_run_reports_warnings(
    tmp_path: Path, bind: Bind
) -> None:
    """A namespace dir mounted over between the plan and its step: the step is refused (only
    the log said so, and the run counted as `ok`). Its warning names the dir and the mount, and
    a run that could not keep its cap is not held (`cachemgr gc` exits 1 on that)."""
    root = Root(tmp_path)
    victim = sglang_victim(tmp_path / "victim")
    before = snapshot(victim)
    with Store.open(root.layout.db_path) as store:
        scan_root(root.layout, store)
        plan = plan_gc(root.layout, store, GcPolicy(max_bytes=1, unbound_ttl=None), now=OLD * 2)
        assert any(s.rel_dir == f"ns/{root.sg}" and s.names for s in plan.steps), plan
        bind(victim, root.site("sglang-ns"))
        report = execute_gc(plan, RunContext(root.layout, store))
    assert snapshot(victim) == before
    said = [w for w in report.warnings if f"ns/{root.sg}" in w]
    assert said and "another mount" in said[0] and "unmount" in said[0], report.warnings
    assert not report.held
    assert report.files > 0  # the other namespaces were collected
