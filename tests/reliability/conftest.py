"""The reliability suite: planted links, poison files, full disks, hostile requests.

Every test here runs beside a *victim* tree outside the cache root. Tests point their planted
symlinks into it (`victim` fixture); after each test, an autouse fixture checks that nothing in
it was created, changed or deleted, whatever the test itself asserted.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytestmark = pytest.mark.reliability

# Names a careless writer or deleter would touch: page and temp names, manifests, a DB, locks.
_VICTIM_FILES = {
    "precious.txt": b"operator data, not a cache page\n",
    "0123456789abcdef0123456789abcdef_Qwen-Qwen3-8B_0_1.bin": b"\x01" * 4096,
    ".0123456789abcdef0123456789abcdef.tmp": b"\x02" * 100,
    "0123456789abcdef.json": b'{"not": "a manifest of ours"}\n',
    "state.db": b"not a database\n",
    "gc.lock": b"someone else's lock\n",
    "sub/deep/page_copy.bin": b"\x03" * 512,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.reliability)


@pytest.fixture
def victim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tree outside every root: planted links point here, and it must never change."""
    base = tmp_path_factory.mktemp("victim")
    for rel, data in _VICTIM_FILES.items():
        path = base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (base / "empty-dir").mkdir()
    return base


def snapshot(tree: Path) -> dict[str, tuple[int, int, str]]:
    """(mode, size, sha256 or link target) of every entry under `tree`, without following links."""
    out: dict[str, tuple[int, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                digest = os.readlink(path)
            else:
                digest = ""
            out[os.path.relpath(path, tree)] = (st.st_mode, st.st_size, digest)
    return out


@pytest.fixture(autouse=True)
def victim_unchanged(victim: Path) -> Iterator[None]:
    """Fail any test after which the victim tree differs in any entry, byte or mode."""
    before = snapshot(victim)
    yield
    after = snapshot(victim)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"files outside the root changed: {changed}"


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A fresh 64 MiB ext4 filesystem, loop-mounted (needs root: CI runs as root).

    4 KiB blocks, as mkfs gives any real root (it picks 1 KiB under 512 MB): SQLite allocates
    its mmapped -shm by writing one byte per 4 KiB page, so on 1 KiB blocks the rest stays a
    hole, and a full disk turns the next touch of it into SIGBUS (seen: test_full_disk.py).
    """
    with loop_fs(tmp_path, "mnt") as mnt:
        yield mnt


@pytest.fixture
def other_small_fs(tmp_path: Path) -> Iterator[Path]:
    """A second filesystem as `small_fs` is (a state dir apart from the root's)."""
    with loop_fs(tmp_path, "other-mnt") as mnt:
        yield mnt


@contextmanager
def loop_fs(tmp_path: Path, name: str) -> Iterator[Path]:
    """A 64 MiB ext4 filesystem mounted at tmp_path/name (see small_fs)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a loop filesystem needs root (CI runs as root)")
    image = tmp_path / f"{name}.img"
    mnt = tmp_path / name
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-b", "4096", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill_with_pages(ns_dir: Path, page_bytes: int = 256 << 10) -> int:
    """Write SGLang-named pages (old mtimes, so no min-age keeps them) until ENOSPC; the count."""
    ns_dir.mkdir(parents=True, exist_ok=True)
    n = before = 0
    old = 1_000_000_000.0
    while True:
        name = f"{n:064x}_Qwen-Qwen3-8B_0_1.bin"
        try:
            with open(ns_dir / name, "wb") as f:
                f.write(os.urandom(page_bytes))
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            (ns_dir / name).unlink(missing_ok=True)
            if page_bytes > 4096:
                page_bytes //= 4  # fill the last corners too
                continue
            # Delayed allocation gives back, at writeback, blocks it held for metadata (and the
            # failed file's): fill those too, or a test that needs no block left for a new dir
            # finds one (seen once in CI). Until a round after a sync takes nothing more.
            os.sync()
            if n == before or os.statvfs(ns_dir).f_bfree == 0:
                return n
            before = n
            continue
        os.utime(ns_dir / name, (old, old))
        n += 1
