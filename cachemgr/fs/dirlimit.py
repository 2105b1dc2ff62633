"""How many entries one flat directory can take before the filesystem says ENOSPC.

ext4 indexes a directory with a hash tree of at most two levels unless the filesystem has the
`large_dir` feature (mke2fs's default features leave it out). Once the root and the one index
block a new name hashes to are full, creating a name fails with ENOSPC, while `df` shows bytes
and inodes free: SGLang's HiCacheFile writes every page into one dir, and its stores fail
there. The number depends on the block size and the names' length: it is the tree's capacity
times the fraction of it a fill reached at ENOSPC (bench/bench_scale.py dirlimit measures it
at 1 KiB and 4 KiB blocks: bench/RESULTS.md), rounded down to the lower of the two.

Whether a filesystem indexes its dirs (`dir_index`) and has `large_dir` is read from its
superblock (the block device named in /proc/self/mountinfo); ext2 and ext3 mounts (the ext4
driver's) are read alike. A device this user cannot read is taken to be as mke2fs makes it by
default (dir_index, no large_dir): the limit is then `assumed`. On overlayfs (a container's
writable layer) the names go to the upper layer's filesystem: read where its upperdir can be
reached, assumed otherwise (ext4 is the usual one under Docker's overlay2, and xfs has no
such limit: a cap it did not need beats stores failing where it was needed).
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path
from typing import NamedTuple

EXT4_MAGIC = 0xEF53
DIR_INDEX = 0x20  # EXT4_FEATURE_COMPAT_DIR_INDEX: hashed dirs (without it, linear: no limit)
LARGE_DIR = 0x4000  # EXT4_FEATURE_INCOMPAT_LARGEDIR
METADATA_CSUM = 0x400  # EXT4_FEATURE_RO_COMPAT_METADATA_CSUM
# Of the tree's capacity, what a fill by SGLang-named pages reached at ENOSPC: 43.6% at 1 KiB
# blocks, 38.1% at 4 KiB (more index blocks: the first to fill does so earlier; measured in
# bench/RESULTS.md), less a margin for another run's hash spread.
FILLED = 0.36


def page_name_len(model: str | None) -> int:
    """The length of an SGLang page name of `model` (the served name, "/" written "-"), with
    a TP rank and size of one digit each; a typical one's without a model."""
    return len(f"{'0' * 64}_{(model or 'Qwen/Qwen3-8B').replace('/', '-')}_0_1.bin")


FLAT_PAGE_NAME_LEN = page_name_len(None)  # a typical page name's length


class DirIndex(NamedTuple):
    """What bounds a flat dir on one filesystem."""

    fstype: str
    block_size: int
    large_dir: bool
    assumed: bool  # the superblock could not be read: mke2fs's default (no large_dir) assumed
    checksums: bool = True  # metadata_csum: each index block keeps 8 bytes for it
    hashed: bool = True  # dir_index: its dirs are hash trees (linear ones have no such limit)

    def limit(self, name_len: int = FLAT_PAGE_NAME_LEN) -> int | None:
        """Entries of `name_len`-byte names one dir takes before ENOSPC; None: no known limit."""
        if self.fstype not in LIMITED or self.large_dir or not self.hashed:
            return None
        return int(tree_capacity(self.block_size, name_len, self.checksums) * FILLED)


def tree_capacity(block_size: int, name_len: int, checksums: bool = True) -> int:
    """Names a full two-level ext4 hash tree holds: root slots × index slots × names a block."""
    tail = 8 if checksums else 0  # struct dx_tail
    root = (block_size - 32 - tail) // 8  # after ".", ".." and dx_root_info
    node = (block_size - 8 - tail) // 8  # after the fake dirent
    leaf = (block_size - (12 if checksums else 0)) // (8 + (name_len + 3) // 4 * 4)
    return root * node * leaf


# The ext4 driver's mounts (ext2 and ext3 included), and an overlay whose upper layer could
# not be read (assumed to be an ext4, as it usually is)
HASHED = frozenset({"ext2", "ext3", "ext4"})
LIMITED = HASHED | {"overlay"}


def dir_index(
    path: str | os.PathLike[str], *, mountinfo: Path = Path("/proc/self/mountinfo")
) -> DirIndex | None:
    """The dir index of the filesystem `path` is on; None if its mount is not found."""
    return _index(path, mountinfo, through_overlay=True)


def _index(
    path: str | os.PathLike[str], mountinfo: Path, *, through_overlay: bool
) -> DirIndex | None:
    st = os.stat(path)
    found = _mount_of(os.major(st.st_dev), os.minor(st.st_dev), mountinfo)
    if found is None:
        return None
    fstype, source, options = found
    bsize = os.statvfs(path).f_bsize
    if fstype == "overlay":
        upper = _option(options, "upperdir")
        # (not from inside its container; nor, once, an upper layer on an overlay itself)
        if through_overlay and upper is not None and os.path.isdir(upper):
            return _index(upper, mountinfo, through_overlay=False)
        return DirIndex(fstype, bsize, False, True)
    if fstype not in HASHED:
        return DirIndex(fstype, bsize, False, False)
    sb = read_superblock(source)
    if sb is None:
        return DirIndex(fstype, bsize, False, True)
    size, large, checksums, hashed = sb
    return DirIndex(fstype, size, large, False, checksums, hashed)


def _option(options: str, name: str) -> str | None:
    """The value of `name=` in a mount's comma-separated super options."""
    for option in options.split(","):
        key, _, value = option.partition("=")
        if key == name:  # (mountinfo writes a space, tab, newline or backslash as \ooo)
            return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), value)
    return None


def _mount_of(major: int, minor: int, mountinfo: Path) -> tuple[str, str, str] | None:
    """(fstype, source, super options) of the mount of device major:minor, from a mountinfo
    file."""
    want = f"{major}:{minor}"
    for line in mountinfo.read_text().splitlines():
        fields = line.split()
        if len(fields) < 3 or fields[2] != want or " - " not in line:
            continue
        after = line.split(" - ", 1)[1].split()
        if len(after) >= 2:
            return after[0], after[1], after[2] if len(after) > 2 else ""
    return None


def read_superblock(device: str) -> tuple[int, bool, bool, bool] | None:
    """(block size, large_dir, metadata_csum, dir_index) from an ext2/3/4 superblock; None if
    the device cannot be read by this user or holds none."""
    try:
        with open(device, "rb") as f:
            f.seek(1024)
            raw = f.read(0x68)
    except OSError:
        return None
    if len(raw) < 0x68 or struct.unpack_from("<H", raw, 0x38)[0] != EXT4_MAGIC:
        return None
    log_block, compat, incompat, ro_compat = (
        struct.unpack_from("<I", raw, 0x18)[0],
        struct.unpack_from("<I", raw, 0x5C)[0],
        struct.unpack_from("<I", raw, 0x60)[0],
        struct.unpack_from("<I", raw, 0x64)[0],
    )
    features = bool(incompat & LARGE_DIR), bool(ro_compat & METADATA_CSUM), bool(compat & DIR_INDEX)
    return 1024 << log_block, *features


def flat_dir_index(path: str | os.PathLike[str]) -> DirIndex | None:
    """The dir index of the filesystem under `path` (None: its mount is not found, or `path`
    does not exist yet: it is read again at the next start)."""
    try:
        return dir_index(path)
    except OSError:
        return None


def flat_dir_limit(path: str | os.PathLike[str]) -> int | None:
    """Entries of typical SGLang page names one dir under `path` takes (None: no known limit,
    or `path` does not exist yet)."""
    index = flat_dir_index(path)
    return index.limit() if index is not None else None
