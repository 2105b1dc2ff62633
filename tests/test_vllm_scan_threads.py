"""The C scanner's parallel walk of vLLM's hashed dirs (_dirscan.c, walk_split): on real trees
with hostile entries it finds exactly what the one-thread walk finds, and never enters what
that walk refuses (symlinks at every level, dirs of no vouched folder, another mount, an
unreadable dir); an exception a walker thread's callback raises reaches the caller."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cachemgr.fs import _dirscan
from cachemgr.fs.dirscan import scan_usage
from cachemgr.fs.root import create_root
from cachemgr.fs.safe import open_dir
from cachemgr.fs.tree import dir_filter
from cachemgr.layout import Layout
from cachemgr.vllm.fstier import VLLM_FS_TIER
from tests.vllmtrees import block_path, key, write_blocks, write_folder

FMT = VLLM_FS_TIER
NS = "0123456789abcdef"
THREADS = (1, 2, 3, 8)


def scans(root: Path) -> list[object]:
    """The raw scan of the namespace dir with each of THREADS walkers, groups in shape order."""
    r, nest = FMT.scan, FMT.nesting
    assert nest is not None
    out = []
    with open_dir(root, f"ns/{NS}") as fd:
        for threads in THREADS:
            groups, other, gone, pages = _dirscan.scan(
                fd,
                threads,
                (r.key_min, r.key_max, r.temp_lead, r.temp_hex),
                FMT.classify,
                len(nest.levels),
                dir_filter(fd, nest),
            )
            out.append((sorted(groups), other, gone, pages))
    return out


def hostile_tree(tmp_path: Path) -> tuple[Path, Path, str, list[str]]:
    """A namespace with ~300 blocks over two ranks and 32- and 64-digit keys, and what a
    co-tenant or a bad day leaves in its hashed dirs."""
    root = tmp_path / "root"
    create_root(Layout.at(root))
    d = Layout.at(root).ns_dir(NS)
    d.mkdir()
    folder = write_folder(d)
    blocks = write_blocks(d, folder, 250, size=100)
    for i in range(40):  # xxhash keys, another size, rank 1
        rel = block_path(folder, key(1000 + i, 32)).replace("_r0/", "_r1/")
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(b"y" * (200 + i % 3))
    leaf = d / blocks[0].rpartition("/")[0]
    k = key(0)
    for name in (f"{k[:63]}.bin", f"{k.upper()}.bin", f"{k}.bin_7.tmp", "x" * 255, ".hidden"):
        (leaf / name).write_bytes(b"near")
    (d / (blocks[1] + f"_{'a' * 32}.tmp")).write_bytes(b"t")  # a vLLM temp
    outside = tmp_path / "outside"
    write_blocks(outside, folder, 20)
    rank = d / f"{folder}_r0"
    os.symlink(outside / f"{folder}_r0", d / f"{folder}_r2")  # a rank dir that is a link
    os.symlink(outside / f"{folder}_r0" / blocks[2].split("/")[1], rank / "fff")
    hhh = rank / blocks[3].split("/")[1]
    os.symlink(outside / blocks[4].rpartition("/")[0], hhh / "ff_g0")
    os.symlink(outside / blocks[5], d / blocks[5].rpartition("/")[0] / f"{key(9999)}.bin")
    (hhh / "junk.bin").write_bytes(b"j")  # a file at a dir level
    (hhh / "zz_g0").mkdir()  # a dir that does not fit its level
    (hhh / "zz_g0" / f"{k}.bin").write_bytes(b"z")
    stray = "Qwen_Qwen3-0.6B_000000000000_r0"  # no folder vouches for it
    write_blocks(d, stray.removesuffix("_r0"), 5)
    return root, d, folder, blocks


def test_the_parallel_walk_finds_what_one_walker_finds(tmp_path: Path) -> None:
    root, _, _, _ = hostile_tree(tmp_path)
    one, *many = scans(root)
    assert all(got == one for got in many)
    usage = scan_usage(Layout.at(root), f"ns/{NS}", FMT)
    assert usage is not None and (usage.pages, usage.files, usage.temps) == (290, 290, 1)
    assert usage.bytes == 250 * 100 + sum(200 + i % 3 for i in range(40))


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="root, setpriv")
def test_unreadable_dirs_and_a_mount_are_skipped_alike_by_every_walker(tmp_path: Path) -> None:
    root, d, folder, blocks = hostile_tree(tmp_path)
    rank = d / f"{folder}_r0"
    (rank / blocks[6].split("/")[1]).chmod(0o000)  # an <hhh> dir: a walker's own subdir
    (d / blocks[7].rpartition("/")[0]).chmod(0o444)  # a leaf: listable, not searchable
    other = tmp_path / "other-fs"
    other.mkdir()
    (other / f"{key(1)}.bin").write_bytes(b"x" * 100)
    at = d / block_path(folder, key(1)).rpartition("/")[0]
    done = subprocess.run(["mount", "--bind", str(other), str(at)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {done.stderr.decode().strip()}")
    try:
        caps = "-dac_override,-dac_read_search"
        code = f"import json; from tests.test_vllm_scan_threads import scans; print(json.dumps(scans(__import__('pathlib').Path({str(root)!r}))))"  # noqa: E501
        run = subprocess.run(
            [
                "setpriv",
                f"--inh-caps={caps}",
                f"--bounding-set={caps}",
                "--",
                sys.executable,
                "-c",
                code,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=Path(__file__).parent.parent,
        )
    finally:
        subprocess.run(["umount", "-l", str(at)], check=True)
        (rank / blocks[6].split("/")[1]).chmod(0o755)
        (d / blocks[7].rpartition("/")[0]).chmod(0o755)
    assert run.returncode == 0, run.stderr
    one, *many = json.loads(run.stdout)
    assert all(got == one for got in many)
    assert one[3] < 290  # the locked dirs' and the mount's blocks are not counted


def test_an_exception_in_a_walker_thread_reaches_the_caller(tmp_path: Path) -> None:
    root, _, _, _ = hostile_tree(tmp_path)
    r, nest = FMT.scan, FMT.nesting
    assert nest is not None
    with open_dir(root, f"ns/{NS}") as fd:
        ok = dir_filter(fd, nest)

        def fails_late(level: int, name: bytes) -> bool:
            if level == 2 and name.startswith(b"f"):  # only below the split: in walkers
                raise LookupError(name)
            return ok(level, name)

        for threads in THREADS:
            with pytest.raises(LookupError):
                _dirscan.scan(
                    fd,
                    threads,
                    (r.key_min, r.key_max, r.temp_lead, r.temp_hex),
                    FMT.classify,
                    len(nest.levels),
                    fails_late,
                )
