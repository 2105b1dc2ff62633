"""A vLLM namespace's hashed dirs as a hostile co-tenant or an operator's bad day leaves them:
another filesystem mounted in a hashed dir, names that nearly match a block's. GC (a real
`cachemgr gc` process), its dry run and a purge delete only vLLM's blocks and temps."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cachemgr.fs.deletion import delete_files
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.state.store import Store
from cachemgr.vllm.fstier import VLLM_FS_TIER
from tests.daemon_helpers import cli_argv
from tests.nsfixtures import cli, cli_process, snapshot
from tests.test_gc_cli import gc
from tests.vllmtrees import block_path, key, vllm_namespace, write_blocks, write_folder

T0 = 1_000_000.0


def vllm_ns(root: Path, blocks: int = 3) -> tuple[Path, str, list[str]]:
    layout = Layout.at(root)
    create_root(layout)
    with Store.open(layout.db_path) as store:
        ns = vllm_namespace(layout, store)
    d = layout.ns_dir(ns)
    folder = write_folder(d)
    return d, folder, write_blocks(d, folder, blocks, size=100, mtime=T0)


@contextmanager
def mounted(source: Path, at: Path, root: Path) -> Iterator[None]:
    """`source` bind-mounted at `at` (root only); unmounted wherever below `root` it went (a
    purge moves it into .trash/) whatever happens."""
    at.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "--bind", str(source), str(at)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {done.stderr.decode().strip()}")
    try:
        yield
    finally:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            if (point := line.split()[1]).startswith(f"{root}/"):
                subprocess.run(["umount", "-l", point], check=True)


def deletes_all(root: Path) -> tuple[dict[str, int], dict[str, int]]:
    """A dry run and a real run of GC with a cap of 1 byte (0 is refused: it reads as "no
    cap"): what each says it deleted."""
    args = ("--json", "--max-bytes", "1", "--min-age", "0")
    dry, real = gc(root, "--dry-run", *args), gc(root, "--yes", *args)
    assert dry.returncode == 0 and real.returncode == 0, dry.stderr + real.stderr
    return json.loads(dry.stdout), json.loads(real.stdout)


def test_a_filesystem_mounted_in_a_hashed_dir_is_never_entered(root: Path, tmp_path: Path) -> None:
    d, folder, _ = vllm_ns(root)
    other = tmp_path / "other-fs"  # say, a disk an operator mounted there to look at
    other.mkdir()
    k = key(100)
    (other / f"{k}.bin").write_bytes(b"not in the cache")
    os.utime(other / f"{k}.bin", (T0, T0))
    before = snapshot(other)
    with mounted(other, d / block_path(folder, k).rpartition("/")[0], root):
        dry, real = deletes_all(root)
        assert snapshot(other) == before
        assert (dry["files"], real["files"]) == (3, 3)
        # named outright (an index row, say), the file is refused, not deleted
        rel = f"ns/{d.name}"
        got = delete_files(root, rel, [block_path(folder, k)], fmt=VLLM_FS_TIER)
        assert got.files == 0 and "another mount" in got.refused[0], got
        assert snapshot(other) == before
        out = cli("--root", str(root), "purge", "--namespace", d.name, "--yes", "--json")
        assert json.loads(out.stdout)["result"]["purged"][0]["pages"] == 0, out.stdout
        assert snapshot(other) == before


def without_dac(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`cachemgr ARGS` as root without the capabilities that bypass file modes, as a daemon
    running as the cache's owner would: a chmod 000 dir is then unreadable to it."""
    caps = "-dac_override,-dac_read_search"
    return subprocess.run(
        [
            "setpriv",
            f"--inh-caps={caps}",
            f"--bounding-set={caps}",
            "--",
            *cli_argv(root),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="root, setpriv")
@pytest.mark.parametrize("mode", [0o000, 0o444])  # not readable; readable, not searchable
def test_an_unreadable_hashed_dir_is_left_alone_and_the_rest_is_collected(
    root: Path, mode: int
) -> None:
    d, _, blocks = vllm_ns(root, blocks=4)
    locked = d / blocks[0].rpartition("/")[0]  # a co-tenant's chmod, another user's umask
    locked.chmod(mode)
    try:
        ls = without_dac(root, "ls", "--json")
        assert ls.returncode == 0, ls.stderr
        (row,) = json.loads(ls.stdout)["namespaces"]
        assert (row["pages"], row["bytes"]) == (3, 300)
        args = ("--json", "--max-bytes", "1", "--min-age", "0")
        dry, real = (
            without_dac(root, "gc", "--dry-run", *args),
            without_dac(root, "gc", "--yes", *args),
        )
        assert dry.returncode == 0 and real.returncode == 0, dry.stderr + real.stderr
        assert json.loads(dry.stdout)["files"] == json.loads(real.stdout)["files"] == 3
    finally:
        locked.chmod(0o755)
    assert [p.name for p in d.rglob("*.bin")] == [blocks[0].rpartition("/")[2]]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="root, setpriv")
def test_a_hashed_dir_gc_may_not_write_stops_only_its_own_deletions(root: Path) -> None:
    d, _, blocks = vllm_ns(root, blocks=4)
    for i, rel in enumerate(blocks):  # the read-only dir's block is the oldest: deleted first
        os.utime(d / rel, (T0 + i, T0 + i))
    locked = d / blocks[0].rpartition("/")[0]
    locked.chmod(0o555)
    try:
        dry = without_dac(root, "gc", "--dry-run", "--json", "--max-bytes", "1", "--min-age", "0")
        real = without_dac(root, "gc", "--yes", "--json", "--max-bytes", "1", "--min-age", "0")
    finally:
        locked.chmod(0o755)
    assert real.returncode != 2, real.stderr  # not an error that ends the run
    got = json.loads(real.stdout)
    assert got["files"] == 3 and "Permission denied" in got["steps"][0]["refused"][0], got
    assert json.loads(dry.stdout)["files"] == 3  # the dry run counts what the real run deletes
    assert [p.name for p in d.rglob("*.bin")] == [blocks[0].rpartition("/")[2]]


def test_names_that_nearly_match_a_block_are_neither_counted_nor_deleted(root: Path) -> None:
    d, _, blocks = vllm_ns(root, blocks=2)
    leaf = d / blocks[0].rpartition("/")[0]
    k = blocks[0].rpartition("/")[2][:64]
    # vLLM's hashes are 32 (xxhash) or 64 (sha256) hex digits; nothing else is its block
    near = [
        f"{k[:63]}.bin",
        f"{k[:33]}.bin",
        f"{k}0.bin",
        f"{k.upper()}.bin",
        f"{k}.bin.tmp",
        f"{k[:40]}.bin_7.tmp",
        f"{k}.bin_x.tmp",
        f"{k}.bin_.tmp",
    ]
    for name in near:
        (leaf / name).write_bytes(b"near")
        os.utime(leaf / name, (T0, T0))
    xx = f"{k[:32]}.bin"  # an xxhash block beside them is one
    (leaf / xx).write_bytes(b"x" * 100)
    os.utime(leaf / xx, (T0, T0))
    (row,) = json.loads(cli("--root", str(root), "ls", "--json").stdout)["namespaces"]
    assert (row["pages"], row["bytes"], row["temps"]) == (3, 300, 0)
    dry, real = deletes_all(root)
    assert (dry["files"], dry["bytes"]) == (real["files"], real["bytes"]) == (3, 300)
    assert sorted(p.name for p in leaf.iterdir()) == sorted(near)


def test_a_config_json_nested_too_deeply_vouches_for_nothing_and_fails_nothing(
    root: Path,
) -> None:
    d, _, _ = vllm_ns(root)
    evil = write_folder(d, model="evil/m")
    (kept,) = write_blocks(d, evil, 1, size=100, start=50, mtime=T0)
    (d / evil / "config.json").write_text("[" * 100_000 + "]" * 100_000)  # json: RecursionError
    ls = cli("--root", str(root), "ls", "--json")
    assert ls.returncode == 0, ls.stderr
    (row,) = json.loads(ls.stdout)["namespaces"]
    assert (row["pages"], row["bytes"]) == (3, 300)
    dry, real = deletes_all(root)
    assert dry["files"] == real["files"] == 3
    assert (d / kept).is_file()


def fill_with_blocks(ns_dir: Path, folder: str, size: int = 256 << 10) -> int:
    """vLLM blocks (old mtimes, so no min-age keeps them) until ENOSPC; how many."""
    n = 0
    while True:
        path = ns_dir / block_path(folder, key(n))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                f.write(b"\0" * size)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            path.unlink(missing_ok=True)
            return n
        os.utime(path, (T0 + n, T0 + n))
        n += 1


def test_the_floor_pass_frees_a_disk_vllm_filled(small_fs: Path) -> None:
    """The full-disk pass (cachemgr.gc.floor: a scan, no DB) deletes vLLM's blocks too."""
    root = small_fs / "root"
    d, folder, _ = vllm_ns(root, blocks=0)
    assert fill_with_blocks(d, folder) > 100
    out = cli_process(
        "--root", str(root), "gc", "--yes", "--json", env={"CACHEMGR_GC_MIN_FREE_PERCENT": "20"}
    )
    assert out.returncode == 0, out.stderr
    floor = [s for s in json.loads(out.stdout)["steps"] if s["reason"] == "free_space"]
    assert floor and not any(s["refused"] for s in floor), floor
    disk = shutil.disk_usage(root)
    assert disk.free >= disk.total * 0.2


def test_blocks_of_another_folder_with_another_size_are_not_torn(root: Path) -> None:
    """Two digest folders in one namespace (vLLM's digest covers fields cachemgr's identity
    need not: blocks_per_file, say): each folder's blocks have their own size, none is torn."""
    d, _, blocks = vllm_ns(root, blocks=6)
    other = write_folder(d, dtype="fp8")
    bigger = write_blocks(d, other, 2, size=400, start=100, mtime=T0)
    out = gc(root, "--yes", "--json", "--min-age", "0")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["files"] == 0
    assert all((d / rel).is_file() for rel in [*blocks, *bigger])
