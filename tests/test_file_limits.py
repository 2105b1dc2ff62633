"""File-count limits (issue 23): the file caps, the inode floor and a flat dir's entry limit,
held by the real GC on real dirs and on real loop-mounted ext4 filesystems."""

from __future__ import annotations

import errno
import json
import math
import os
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from cachemgr.daemon.metrics import CachemgrCollector, Parts
from cachemgr.doctor.dirindex import lint_dir_entries
from cachemgr.fs.dirlimit import DirIndex, dir_index, flat_dir_limit, page_name_len, tree_capacity
from cachemgr.fs.root import create_root
from cachemgr.fs.usage import inode_usage
from cachemgr.gc.plan import flat_names
from cachemgr.gc.policy import Files, GcPolicy, Inodes, over_file_limits
from cachemgr.gc.runner import GcRunner
from cachemgr.gc.step import GcReport
from cachemgr.layout import Layout
from cachemgr.ns.status import NamespaceStatus, namespace_statuses
from cachemgr.settings import Settings
from cachemgr.state.index import scan_root
from tests.daemon_helpers import IDENTITY, captured_log, register_namespace
from tests.gc_helpers import NS, NS2, T0, Entries, Tree, big_disk, page, policy
from tests.test_gc_refusals import immutable

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="loop mounts need root (CI is root)")


@contextmanager
def ext4(base: Path, size_mib: int, *options: str, kind: str = "ext4") -> Iterator[Path]:
    """A fresh ext4 (or `kind`: ext3) made with `options`, loop-mounted at base/mnt."""
    image, mnt = base / "fs.img", base / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    subprocess.run([f"mkfs.{kind}", "-q", "-F", "-m", "0", *options, str(image)], check=True)
    subprocess.run(["mount", "-t", kind, "-o", "loop", str(image), str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(d: Path, start: int = 0, model: str = "m") -> int:
    """Empty SGLang-named pages of `model` with old mtimes until ENOSPC; how many were made."""
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    n = start
    try:
        while True:
            try:
                os.mknod(page(n, model), stat.S_IFREG | 0o644, dir_fd=fd)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                return n - start
            os.utime(page(n, model), (T0, T0), dir_fd=fd)
            n += 1
    finally:
        os.close(fd)


def stored_of(d: Path, start: int, tries: int, model: str = "m") -> int:
    """How many of `tries` new SGLang-named pages (numbers from `start`) the dir takes, going on
    past ENOSPC as a server does: each refused store is one lost page, not the end."""
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    stored = 0
    try:
        for n in range(start, start + tries):
            try:
                os.mknod(page(n, model), stat.S_IFREG | 0o644, dir_fd=fd)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                continue
            os.utime(page(n, model), (T0, T0), dir_fd=fd)
            stored += 1
    finally:
        os.close(fd)
    return stored


def fill_full(d: Path, model: str = "m", window: int = 1000) -> int:
    """Fill past the first ENOSPC until the dir refuses half of a `window` of new pages (the
    first ENOSPC is one full index block: the dir still takes ~99% of new names then); the
    number of the next page."""
    n = fill(d, model=model)
    while stored_of(d, n, window, model) > window // 2:
        n += window
    return n + window


def indexed(root: Path, ns: str) -> Tree:
    """A root over ns's pages as they are on disk, indexed as a scan would."""
    tree = Tree.at(root)
    names = sorted(os.listdir(tree.dir(ns)))
    tree.stored(ns, names, at=T0)
    return tree


def ratio(tree: Tree) -> float:
    """cachemgr_namespace_dir_entries_limit_ratio of NS, from a private registry."""

    @contextmanager
    def reader() -> Iterator[sqlite3.Connection]:
        yield tree.store.conn

    reg = CollectorRegistry(auto_describe=False)
    reg.register(CachemgrCollector(tree.layout, reader))
    labels = {"namespace": NS, "engine": "sglang"}
    value = reg.get_sample_value("cachemgr_namespace_dir_entries_limit_ratio", labels)
    assert value is not None
    return value


def status(pages: int) -> NamespaceStatus:
    return NamespaceStatus(
        id=NS,
        state="active",
        has_dir=True,
        pages=pages,
        files=pages,
        bytes=0,
        page_reads=0,
        page_writes=0,
    )


def test_doctor_warns_from_80_percent_of_the_dir_limit() -> None:
    index = DirIndex("ext4", 4096, False, False)
    limit = index.limit()
    assert limit is not None
    found = [
        lint_dir_entries([status(math.ceil(limit * share))], index) for share in (0.79, 0.8, 0.96)
    ]
    assert [[f.severity for f in fs] for fs in found] == [[], ["warning"], ["error"]]
    assert "80% of the about" in found[1][0].message
    assert lint_dir_entries([status(limit)], DirIndex("ext4", 4096, True, False)) == []
    assert lint_dir_entries([status(limit)], None) == []
    # Files GC does not delete, over its cap alone: evicting pages is no fix.
    full_of_others = status(10).model_copy(update={"foreign_files": math.ceil(limit * 0.81)})
    (finding,) = lint_dir_entries([full_of_others], index)
    assert finding.fix.startswith(f"{math.ceil(limit * 0.81):,} of them are temp or other files")
    assert "let GC keep it" in found[1][0].fix


def test_file_caps_are_held_by_gc_like_the_byte_caps(tmp_path: Path) -> None:
    """300 + 100 pages under a root cap of 300 files and a namespace cap of 200: each comes
    down to its low watermark (reason `files`), and the dry run lists what the run deletes."""
    tree = Tree.at(tmp_path / "root")
    tree.write(NS, [page(i) for i in range(300)], at=T0)
    tree.write(NS2, [page(i) for i in range(1000, 1100)], at=T0 + 1)
    pol = policy(max_files=300, namespace_max_files=200)
    dry = tree.execute(tree.plan(pol, now=T0 + 10), now=T0 + 10, dry_run=True)
    report = tree.execute(tree.plan(pol, now=T0 + 10), now=T0 + 10)
    assert {r.reason for r in report.steps} == {"files"}
    assert [(s.rel_dir, s.files) for s in dry.steps] == [(s.rel_dir, s.files) for s in report.steps]
    # NS: 300 > 200 × 0.95, down to 170; then the root: 270 > 285? no: left as it is.
    assert len(tree.files(NS)) == 170
    assert len(tree.files(NS2)) == 100
    # The root's cap: 270 files over a cap of 250 go down to 212 (250 × 0.85).
    report = tree.execute(tree.plan(policy(max_files=250), now=T0 + 20), now=T0 + 20)
    assert len(tree.files(NS)) + len(tree.files(NS2)) == 212
    assert report.totals()["files"][0] == 58


def test_file_caps_count_each_ranks_file_of_a_page(tmp_path: Path) -> None:
    """A TP-2 server stores a page as two files, one a rank. The caps counted pages: 200
    files under a cap of 100 looked like 100 pages, under the high watermark, and GC held
    nothing while the run said held; the entry limit and its ratio did the same."""
    tree = Tree.at(tmp_path / "root")
    names = [f"{i:064x}_m_{rank}_2.bin" for i in range(100) for rank in (0, 1)]
    tree.write(NS, names, at=T0)
    report = tree.execute(tree.plan(policy(namespace_max_files=100), now=T0 + 10), now=T0 + 10)
    assert report.held and {r.reason for r in report.steps} == {"files"}
    assert len(tree.files(NS)) <= 85  # the low watermark, in files
    assert len(tree.files(NS)) % 2 == 0  # whole pages: both ranks' files of each went
    tree.write(
        NS, [f"{i:064x}_m_{rank}_2.bin" for i in range(500, 600) for rank in (0, 1)], at=T0 + 15
    )
    report = tree.execute(tree.plan(policy(max_files=150), now=T0 + 20), now=T0 + 20)
    assert report.held and len(tree.files(NS)) <= int(150 * 0.85)
    scanned = NamespaceStatus(
        id=NS,
        state="active",
        has_dir=True,
        pages=10,
        files=20,
        bytes=0,
        page_reads=0,
        page_writes=0,
        temp_files=1,
    )
    assert scanned.dir_entries == 21


def test_the_entry_limit_is_for_the_longest_names_the_dir_has_held(tmp_path: Path) -> None:
    """Pages with a pool in their names (DeepSeek's indexer) are longer than the identity's
    model alone makes them: the limit, and the cap GC keeps under it, were computed for the
    shorter names, so the dir could reach ENOSPC under GC's cap. Doctor, the metric and GC
    all take the longest name the index has seen."""
    tree = Tree.at(tmp_path / "root")
    long = [page(i, pool="deepseek_v4_c4_indexer_scale") for i in range(3)]
    tree.write(NS, long, at=T0)
    (st,) = [s for s in namespace_statuses(tree.store.conn, tree.layout) if s.id == NS]
    assert st.longest_name == len(long[0]) > page_name_len(st.model)
    index = DirIndex("ext4", 1024, False, False)
    shorter = index.limit(page_name_len(st.model))
    assert shorter is not None and st.entry_limit(index) == index.limit(len(long[0])) < shorter
    assert flat_names(tree.store.conn, [NS]) == {NS: len(long[0])}


def test_file_caps_come_from_the_settings(tmp_path: Path) -> None:
    s = Settings(
        root=tmp_path, gc_max_files=10, gc_namespace_max_files=5, gc_min_free_inodes_percent=7
    )
    pol = GcPolicy.from_settings(s, dir_index=lambda _: None)
    assert (pol.max_files, pol.namespace_max_files, pol.min_free_inodes_percent) == (10, 5, 7)
    assert Settings.model_fields["gc_min_free_inodes_percent"].default == 5  # the suite sets 0


def test_a_flat_namespace_is_capped_under_its_dirs_entry_limit() -> None:
    """Unset, the namespace file cap of a flat dir is 80% of its entry limit; a configured
    cap under that wins."""
    flat = Files({NS: 1000}, {NS: page_name_len(None)})
    low = policy().low_watermark
    by_ns, _, _ = over_file_limits(policy(dir_entries=Entries(1000)), flat)
    assert by_ns == {NS: (1000 - math.floor(800 * low), "dir_full")}
    capped = policy(dir_entries=Entries(1000), namespace_max_files=500)
    assert over_file_limits(capped, flat)[0] == {NS: (1000 - math.floor(500 * low), "files")}
    assert over_file_limits(policy(), flat)[0] == {}


def test_the_limit_is_under_what_was_measured() -> None:
    """The limit stays under the fills bench_scale measured (bench/RESULTS.md) and is none
    with large_dir or on another filesystem."""
    four = DirIndex("ext4", 4096, False, False).limit()
    one = DirIndex("ext4", 1024, False, False).limit()
    assert four is not None and one is not None
    assert 0.9 * 4_137_269 < four < 4_137_269
    assert one < 67_561
    assert DirIndex("ext4", 4096, True, False).limit() is None
    assert DirIndex("xfs", 4096, False, False).limit() is None
    assert tree_capacity(4096, 86) == 507 * 510 * 42


@ROOT_ONLY
def test_large_dir_is_read_from_the_superblock(tmp_path: Path) -> None:
    for name, feature, large in (("plain", "^large_dir", False), ("large", "large_dir", True)):
        (tmp_path / name).mkdir()
        with ext4(tmp_path / name, 16, "-b", "1024", "-O", feature) as mnt:
            index = dir_index(mnt)
            assert index == DirIndex("ext4", 1024, large, False, True)
            assert (flat_dir_limit(mnt) is None) == large
    assert flat_dir_limit(tmp_path / "absent") is None


@ROOT_ONLY
def test_ext3_overlays_and_unindexed_dirs_get_the_limit_they_have(tmp_path: Path) -> None:
    """ext3 (the ext4 driver's mount) has the same hash trees and had no limit; a dir made
    without dir_index (linear) has none and was given one; an overlay (a container's writable
    layer) on a limited ext4 had none: its upper layer's is read, and where that cannot be
    reached from here (inside the container) the usual ext4 is assumed, and doctor says so."""
    (tmp_path / "e3").mkdir()
    with ext4(tmp_path / "e3", 16, "-b", "1024", kind="ext3") as mnt:
        index = dir_index(mnt)
        assert index is not None and (index.fstype, index.hashed) == ("ext3", True)
        assert flat_dir_limit(mnt) == DirIndex("ext4", 1024, False, False, False).limit()
    (tmp_path / "linear").mkdir()
    with ext4(tmp_path / "linear", 16, "-b", "1024", "-O", "^dir_index") as mnt:
        index = dir_index(mnt)
        assert index is not None and not index.hashed and flat_dir_limit(mnt) is None
    (tmp_path / "up").mkdir()
    with ext4(tmp_path / "up", 16, "-b", "1024", "-O", "^large_dir") as under:
        layers = {name: under / name for name in ("lower", "upper", "work")}
        for d in layers.values():
            d.mkdir()
        merged = tmp_path / "merged"
        merged.mkdir()
        spec = ",".join(f"{name}dir={d}" for name, d in layers.items())
        mounted = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", spec, str(merged)])
        if mounted.returncode != 0:
            pytest.skip("no overlayfs mount here")
        try:
            assert flat_dir_limit(merged) == flat_dir_limit(under) is not None
            # Inside a container the upperdir's path is the host's: not reachable.
            st = os.stat(merged)
            mountinfo = tmp_path / "mountinfo"
            mountinfo.write_text(
                f"99 1 {os.major(st.st_dev)}:{os.minor(st.st_dev)} / {merged} rw - overlay "
                "overlay rw,lowerdir=/var/lib/docker/l,upperdir=/var/lib/docker/u/diff\n"
            )
            seen = dir_index(merged, mountinfo=mountinfo)
            assert seen is not None and (seen.fstype, seen.assumed) == ("overlay", True)
            assert seen.limit() == DirIndex("ext4", seen.block_size, False, True).limit()
            limit = seen.limit()
            assert limit is not None
            (finding,) = lint_dir_entries([status(limit)], seen)
            assert "upper layer of this overlay" in finding.message
            # An upperdir with a space is written \040 there: read as the path it is.
            spaced = under / "up per"
            spaced.mkdir()
            escaped = str(spaced).replace(" ", "\\040")
            dev = f" {os.major(st.st_dev)}:{os.minor(st.st_dev)} "
            lines = Path("/proc/self/mountinfo").read_text().splitlines()
            lines = [
                f"{line.split(' - ')[0]} - overlay overlay rw,upperdir={escaped}"
                if dev in line
                else line
                for line in lines
            ]
            mountinfo.write_text("\n".join(lines) + "\n")
            assert dir_index(merged, mountinfo=mountinfo) == dir_index(under)
        finally:
            subprocess.run(["umount", "-l", str(merged)], check=False)


@ROOT_ONLY
def test_a_full_dir_index_is_freed_like_a_full_disk(tmp_path: Path) -> None:
    """A flat namespace on a 1 KiB-block ext4 without large_dir, filled until the dir index
    says ENOSPC with bytes and inodes free: GC (defaults, no file cap set) evicts it under
    80% of the limit for reason dir_full, its log line says so, and the server may store
    again."""
    with ext4(tmp_path, 256, "-b", "1024", "-N", "300000", "-O", "^large_dir") as mnt:
        root = mnt / "root"
        create_root(Layout.at(root))
        made = fill_full(root / "ns" / NS)
        free_inodes = inode_usage(mnt)[1]
        assert free_inodes > 10_000 and os.statvfs(mnt).f_bavail > 10_000
        # Before any index (no daemon): doctor counts the dir, not the DB's 0 pages.
        unindexed = subprocess.run(
            [sys.executable, "-m", "cachemgr", "--root", str(root), "doctor", "--json"],
            capture_output=True,
            text=True,
        )
        (full,) = [f for f in json.loads(unindexed.stdout) if f["code"] == "dir-index-full"]
        entries = len(os.listdir(root / "ns" / NS))
        assert full["severity"] == "error" and f"{entries:,} entries" in full["message"]
        tree = indexed(root, NS)
        assert ratio(tree) > 1.0
        doctor = subprocess.run(
            [sys.executable, "-m", "cachemgr", "--root", str(root), "doctor"],
            capture_output=True,
            text=True,
        )
        assert doctor.returncode == 2 and "error   dir-index-full: ns " in doctor.stdout
        limit = flat_dir_limit(root)
        index = dir_index(root)
        pol = GcPolicy(min_free_percent=0.0, min_free_inodes_percent=0.0, dir_entries=index)
        assert limit is not None and made > limit
        runner = GcRunner(tree.layout, tree.store, pol, disk_usage=big_disk)
        dry = runner.run(dry_run=True)
        with captured_log("cachemgr.gc.execute") as log:
            report = runner.run()
        runner.leadership.release()
        assert report.totals().keys() == {"dir_full"}
        assert report.files == dry.files > 0
        left = len(os.listdir(root / "ns" / NS))
        assert left == int(limit * 0.8 * 0.85)
        done = [line for line in log.lines if line["msg"] == "gc done"]
        assert "dir_full" in done[0]["by_reason"]  # type: ignore[operator]
        assert ratio(tree) < 0.8
        # Stores succeed again: not every one (a name whose leaf of the index lost no page
        # to GC is still refused: ext4 never shrinks an index), but ≥95% (measured 99%+).
        assert stored_of(root / "ns" / NS, made, 1000) >= 950
        tree.store.close()


@ROOT_ONLY
def test_the_inode_floor_is_kept_at_zero_free_inodes(tmp_path: Path) -> None:
    """An ext4 of 64 inodes filled with pages until no inode is left: the floor pass, which
    needs neither the DB nor an inode, frees inodes back over the floor (reason free_inodes),
    and the audit row goes into the DB that was open before."""
    with ext4(tmp_path, 32, "-N", "64") as mnt:
        root = mnt / "root"
        tree = Tree.at(root)  # the state DB on the same filesystem, opened before it fills
        fill(root / "ns" / NS)
        assert inode_usage(mnt)[1] == 0
        pol = policy(min_free_inodes_percent=5.0)
        runner = GcRunner(tree.layout, tree.store, pol, disk_usage=big_disk)
        dry = runner.run(dry_run=True, sweep=False)
        report = runner.run(sweep=False)
        runner.leadership.release()
        assert report.totals()["free_inodes"][0] == dry.totals()["free_inodes"][0] > 0
        total, free = inode_usage(mnt)
        assert free >= pol.inode_floor(Inodes(total, free)) > 0
        assert runner.needs_gc() == ()
        row = tree.store.conn.execute(
            "SELECT SUM(pages) FROM audit WHERE reason = 'free_inodes'"
        ).fetchone()
        assert row[0] == report.files
        tree.store.close()


@ROOT_ONLY
def test_an_inode_floor_pass_that_is_refused_says_so(tmp_path: Path) -> None:
    """0 inodes left and every page in a dir GC may not unlink in (chattr +i): the floor pass,
    which may be all a run can do (a CLI's DB does not open), says which files it kept and
    how to fix it in its report and its log line, and the run counts as short."""
    with ext4(tmp_path, 32, "-N", "64") as mnt:
        root = mnt / "root"
        tree = Tree.at(root)
        fill(root / "ns" / NS)
        tree.stored(NS, sorted(os.listdir(tree.dir(NS))), at=T0)
        pol = policy(min_free_inodes_percent=5.0)
        runner = GcRunner(tree.layout, tree.store, pol, disk_usage=big_disk)
        try:
            with immutable(tree.dir(NS)), captured_log("cachemgr.gc.floor") as log:
                report = runner.free_floor()
        finally:
            runner.leadership.release()
            tree.store.close()
        assert report is not None and not report.held and report.files == 0
        assert runner.stats.short == 1
        said = [w for w in report.warnings if "cannot be deleted by uid 0" in w]
        assert said and "chattr -i" in said[0]
        (line,) = log.lines
        assert line["held"] is False and line["warnings"] == list(report.warnings)


@ROOT_ONLY
def test_the_inode_floor_pass_leaves_a_file_cap_to_the_regular_plan(tmp_path: Path) -> None:
    """Below the inode floor with a file cap lower still: the floor pass (by mtime, no DB)
    frees what the inode floor needs, and the regular plan evicts the rest for the cap, in
    the index's order and under its own reason; the pass took the cap's whole excess."""
    with ext4(tmp_path, 32, "-N", "64") as mnt:
        root = mnt / "root"
        tree = Tree.at(root)
        made = fill(root / "ns" / NS)
        tree.stored(NS, sorted(os.listdir(tree.dir(NS))), at=T0)
        total = inode_usage(mnt)[0]
        floor = math.ceil(total * 0.05)
        inode_need = made - math.floor((made - floor) * 0.85)  # its files + 0 free - floor
        pol = policy(min_free_inodes_percent=5.0, max_files=10)
        runner = GcRunner(tree.layout, tree.store, pol, disk_usage=big_disk)
        try:
            dry = runner.run(dry_run=True, sweep=False)
            report = runner.run(sweep=False)
        finally:
            runner.leadership.release()
            tree.store.close()
        assert report.totals()["free_inodes"][0] == dry.totals()["free_inodes"][0] == inode_need
        assert report.totals()["files"][0] == dry.totals()["files"][0] == made - inode_need - 8
        assert len(os.listdir(root / "ns" / NS)) == math.floor(10 * 0.85)


@ROOT_ONLY
def test_a_long_model_name_is_capped_under_its_own_dir_limit(tmp_path: Path) -> None:
    """SGLang names pages after the served model name, the model path when none is given: a
    long one fills a dir index with far fewer entries than a typical name. GC on its defaults
    held the typical name's cap, so this dir was full (ENOSPC) while GC found nothing to do
    and doctor said to let GC keep it; it must hold the cap doctor and the metric compute."""
    model = "/models/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/" + "0123456789abcdef" * 3
    with ext4(tmp_path, 256, "-b", "1024", "-N", "100000", "-O", "^large_dir") as mnt:
        root = mnt / "root"
        tree = Tree.at(root)
        try:
            _fill_and_collect(tree, model)
        finally:
            tree.store.close()


def _fill_and_collect(tree: Tree, model: str) -> None:
    """Fill NS (pages of `model`, registered so) until ENOSPC, then run GC on its defaults."""
    root = tree.layout.root
    mnt = root.parent
    identity = {**IDENTITY, "source": {**IDENTITY["source"], "served_model_name": model}}
    register_namespace(tree.layout, NS, identity=identity)
    made = fill_full(root / "ns" / NS, model=model.replace("/", "-"))
    assert inode_usage(mnt)[1] > 10_000 and os.statvfs(mnt).f_bavail > 10_000
    tree.stored(NS, sorted(os.listdir(tree.dir(NS))), at=T0)
    index = dir_index(root)
    assert index is not None
    limit = index.limit(page_name_len(model))
    assert limit is not None and made > limit  # the dir is full past doctor's limit
    pol = GcPolicy.from_settings(Settings(root=root, gc_min_age=0))
    runner = GcRunner(tree.layout, tree.store, pol, disk_usage=big_disk)
    try:
        dry = runner.run(dry_run=True)
        report = runner.run()
    finally:
        runner.leadership.release()
    assert report.totals().keys() == {"dir_full"}
    assert report.files == dry.files > 0
    assert len(os.listdir(root / "ns" / NS)) == math.floor(int(limit * 0.8) * 0.85)
    assert ratio(tree) < 0.8
    assert stored_of(root / "ns" / NS, made, 1000, model.replace("/", "-")) >= 950


def _entries_run(tmp_path: Path, foreign: int) -> tuple[GcReport, set[str]]:
    """60 pages and `foreign` files that are not pages in a flat dir of 100 entries (its cap
    80: GC starts above 76 entries, evicts down to 68); one GC run, and what is left."""
    tree = Tree.at(tmp_path / "root")
    try:
        tree.write(NS, [page(i) for i in range(60)], at=T0)
        for i in range(foreign):
            (tree.dir(NS) / f"notes-{i}.txt").write_text("an operator's file\n")
        scan_root(tree.layout, tree.store)  # the daemon's scan counts the dir's foreign files
        runner = GcRunner(tree.layout, tree.store, policy(dir_entries=Entries(100)))
        try:
            report = runner.run()
        finally:
            runner.leadership.release()
        return report, tree.files(NS)
    finally:
        tree.store.close()


def test_the_entry_limit_counts_a_flat_dirs_other_files(tmp_path: Path) -> None:
    """A dir's index holds every entry: 60 pages beside 25 foreign files are 85 entries, over
    the 76 of dir_full's high watermark. GC counted pages alone (60, under it) and ran held
    while the server's stores failed with ENOSPC; it now evicts down to 68 entries."""
    report, left = _entries_run(tmp_path, 25)
    assert report.totals() == {"dir_full": (17, 17_000)}
    assert report.held
    assert len(left) == 68 and sum(n.startswith("notes-") for n in left) == 25


def test_a_dir_full_of_other_files_is_an_unmet_entry_limit(tmp_path: Path) -> None:
    """80 foreign files alone are over dir_full's high watermark: every page goes and the
    limit is unmet (the run is not held), not a run that held with the dir past its limit."""
    report, left = _entries_run(tmp_path, 80)
    assert report.totals() == {"dir_full": (60, 60_000)}
    assert not report.held
    assert [(u.reason, u.namespace_id, u.excess) for u in report.unmet] == [("dir_full", NS, 12)]
    assert len(left) == 80


def test_a_dir_full_of_other_files_stays_unmet_once_its_pages_are_gone(tmp_path: Path) -> None:
    """The run that evicts every page leaves dir_full unmet; the daemon's next ticks found the
    namespace without pages out of GC's view, counted nothing crossed and set
    cachemgr_gc_limits_unmet{limit="dir_full"} back to 0, while the dir was as full (doctor
    and cachemgr_namespace_dir_entries_limit_ratio still said so)."""
    tree = Tree.at(tmp_path / "root")
    try:
        tree.write(NS, [page(i) for i in range(60)], at=T0)
        for i in range(80):
            (tree.dir(NS) / f"notes-{i}.txt").write_text("an operator's file\n")
        scan_root(tree.layout, tree.store)
        runner = GcRunner(tree.layout, tree.store, policy(dir_entries=Entries(100)))

        @contextmanager
        def reader() -> Iterator[sqlite3.Connection]:
            yield tree.store.conn

        reg = CollectorRegistry(auto_describe=False)
        reg.register(CachemgrCollector(runner.layout, reader, Parts(gc=runner)))
        runner.last_sweep = math.inf  # (no sweep due: this is about the limits)
        try:
            for _ in range(3):
                runner.tick()
                scan_root(tree.layout, tree.store)  # the daemon's index, after the deletions
                unmet = [(u.reason, u.namespace_id, u.excess) for u in runner.stats.unmet]
                assert unmet == [("dir_full", NS, 12)]
                assert reg.get_sample_value("cachemgr_gc_limits_unmet", {"limit": "dir_full"}) == 1
            assert tree.files(NS) == {f"notes-{i}.txt" for i in range(80)}
            (tree.dir(NS) / "notes-0.txt").unlink()  # the operator moves some out
            for i in range(1, 20):
                (tree.dir(NS) / f"notes-{i}.txt").unlink()
            scan_root(tree.layout, tree.store)
            runner.tick()
            assert runner.stats.unmet == ()
            assert reg.get_sample_value("cachemgr_gc_limits_unmet", {"limit": "dir_full"}) == 0
        finally:
            runner.leadership.release()
    finally:
        tree.store.close()
