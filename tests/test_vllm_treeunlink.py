"""Deleting a vLLM namespace's blocks many hashed dirs per call into C (cachemgr.fs.treeunlink,
_unlink.unlink_tree): only blocks and temps of vouched dirs, never through a symlink at any
level, a dry run that says what the real run does, and a stop when a dir is moved away."""

from __future__ import annotations

import os
from pathlib import Path

from cachemgr.fs._dirscan import mount_id
from cachemgr.fs._unlink import unlink_tree
from cachemgr.fs.deletecheck import NOT_REACHED
from cachemgr.fs.deletion import Listeners, Pacer, delete_files
from cachemgr.fs.dirscan import list_files
from cachemgr.layout import Layout
from cachemgr.vllm.fstier import VLLM_FS_TIER
from tests.nsfixtures import snapshot
from tests.test_vllm_scan_threads import NS, hostile_tree
from tests.vllmtrees import key

FMT = VLLM_FS_TIER


def test_blocks_and_temps_go_and_nothing_else_dry_run_alike(tmp_path: Path) -> None:
    root, d, folder, blocks = hostile_tree(tmp_path)
    listed = [f.name for f in list_files(Layout.at(root), f"ns/{NS}", fmt=FMT)]
    assert len(listed) == 291  # 290 blocks and a temp
    rank = f"{folder}_r0"
    hhh = blocks[3].split("/")[1]
    hostile = [
        f"{rank}/fff/{blocks[2].split('/', 2)[2]}",  # through a linked <hhh> dir
        f"{rank}/{hhh}/ff_g0/{key(4)}.bin",  # through a linked leaf dir
        f"{blocks[5].rpartition('/')[0]}/{key(9999)}.bin",  # a block name that is a link
        f"{rank}/{hhh}/zz_g0/{key(0)}.bin",  # a dir that does not fit its level
        f"{folder}_r2/{blocks[0].split('/', 1)[1]}",  # a rank dir that is a link
        f"{rank}/{key(0)}.bin",  # a block name at a dir level
        f"{blocks[0].rpartition('/')[0]}/{key(0)[:63]}.bin",  # not a block name
        f"{folder}/config.json",
    ]
    outside, before = tmp_path / "outside", snapshot(tmp_path / "outside")
    keep = {p for p in snapshot(d) if p not in listed}
    dry = delete_files(root, f"ns/{NS}", [*listed, *hostile], fmt=FMT, dry_run=True)
    real = delete_files(root, f"ns/{NS}", [*listed, *hostile], fmt=FMT)
    assert (dry.files, dry.bytes, dry.refused) == (real.files, real.bytes, real.refused)
    assert real.files == 291 and len(real.refused) == len(hostile), real.refused
    assert snapshot(outside) == before
    assert set(snapshot(d)) == keep


def test_a_top_dir_no_longer_in_its_parent_stops_every_unlink(tmp_path: Path) -> None:
    root, d, _, blocks = hostile_tree(tmp_path)
    dirs = sorted({b.rpartition("/")[0] for b in blocks})
    names = [[b.rpartition("/")[2] for b in blocks if b.startswith(s + "/")] for s in dirs]
    top = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    parent = os.open(d.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        other = os.stat(root)  # the entry must be (dev, inode) of ns/<id>; this is not it
        results, moved = unlink_tree(
            top,
            parent,
            d.name,
            other.st_dev,
            other.st_ino,
            mount_id(top),
            dirs,
            names,
            0.0,
            0.0,
            8,
            0,
            False,
        )
    finally:
        os.close(top)
        os.close(parent)
    assert moved
    assert {s for _, verdicts in results for s, _ in verdicts} == {NOT_REACHED}
    assert all((d / b).is_file() for b in blocks)


def test_a_rank_dir_swapped_for_a_link_mid_run_is_not_followed(tmp_path: Path) -> None:
    root, d, folder, blocks = hostile_tree(tmp_path)
    rank, away = d / f"{folder}_r0", tmp_path / "moved-away"

    def swap(_: float) -> None:  # between two parts: what a co-tenant's mv + ln -s does
        if not away.exists():
            rank.rename(away)
            rank.symlink_to(away)

    pacer = Pacer(rate=1e-3, batch=1, sleep=swap)
    report = delete_files(root, f"ns/{NS}", blocks, fmt=FMT, listeners=Listeners(pacer))
    left = sum((away / b.split("/", 1)[1]).is_file() for b in blocks)
    assert report.files + left == len(blocks) and left > 200
    assert any("not a directory" in why for why in report.refused), report.refused


def test_the_deepest_longest_paths_unlink_on_the_workers_small_stacks(tmp_path: Path) -> None:
    """The workers run on 256 KiB stacks: every component and name at NAME_MAX (255 bytes),
    eight dirs deep (2 KiB of path below the top), on eight threads, each dir opened a
    component at a time and each component checked again before each unlink."""
    top_dir = tmp_path / "top"
    comps = [chr(ord("a") + k) * 255 for k in range(8)]
    dirs = ["/".join(comps[: k + 1]) for k in range(8)]
    names = [f"{i:03d}" + "x" * 252 for i in range(16)]
    top_dir.mkdir()
    top = os.open(top_dir, os.O_RDONLY | os.O_DIRECTORY)
    parent = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for rel in dirs:
            at = os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=top)
            for comp in rel.split("/")[:-1]:
                at, old = os.open(comp, os.O_RDONLY | os.O_DIRECTORY, dir_fd=at), at
                os.close(old)
            os.mkdir(rel.rpartition("/")[2], dir_fd=at)
            at, old = os.open(rel.rpartition("/")[2], os.O_RDONLY, dir_fd=at), at
            os.close(old)
            for n in names:
                os.close(os.open(n, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=at))
            os.close(at)
        st = os.stat(top_dir)
        args = (top, parent, "top", st.st_dev, st.st_ino, mount_id(top), dirs, [names] * 8)
        results, moved = unlink_tree(*args, 0.0, 0.0, 8, 0, False)
        left = sum(len(files) for _, _, files, _ in os.fwalk(".", dir_fd=top))
    finally:
        os.close(top)
        os.close(parent)
    assert not moved and len(dirs[-1]) == 2047
    assert [(s, {v for v, _ in verdicts}) for s, verdicts in results] == [(0, {0})] * 8
    assert left == 0
