"""Room kept back for the state DB: a preallocated file in the state dir, given back when the
filesystem is full.

SQLite needs new blocks to open a WAL database (its -shm and -wal files are created on open)
and to write anything, and the state DB lives by default on the filesystem the cache fills.
So the state dir holds `space-reserve`, a file of a few MiB allocated (not written: fallocate)
whenever the DB is opened with room to spare. When an open or a write fails for lack of space
it is truncated to nothing: the blocks go back to the filesystem and the DB can work again
while GC frees space. It is allocated again once the filesystem has room for it twice over.

Every open goes through cachemgr.fs.safe (no symlink followed, regular files only).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

from cachemgr.errors import UnsafePathError
from cachemgr.fs.safe import open_dir, open_regular
from cachemgr.fs.usage import inode_usage
from cachemgr.layout import DB_FILE, RESERVE_FILE

log = logging.getLogger(__name__)
RESERVE_BYTES = 4 << 20  # an open (32 KiB -shm), a few thousand index rows, an audit row
# What the DB's -wal file grows to between two checkpoints: SQLite's default autocheckpoint
# (1,000 pages) of 4 KiB pages; a longer transaction's is truncated back to it after the next
# checkpoint (cachemgr.state.store sets journal_size_limit). Measured on a 64 MiB filesystem:
# a 73 KiB DB beside a 2.6 MiB -wal, which had put free space a third of a MiB under the floor.
WAL_BYTES = 1000 * 4096
_SQLITE_FULL = (sqlite3.SQLITE_FULL,)
_OS_FULL = (errno.ENOSPC, errno.EDQUOT)


def reserve_size(fs_bytes: int) -> int:
    """How much to keep back on a filesystem of `fs_bytes`: 4 MiB, at most 1/16 of it."""
    return min(RESERVE_BYTES, fs_bytes // 16)


def wal_room(fs_bytes: int) -> int:
    """What GC plans the -wal file to grow to: WAL_BYTES, at most 1/16 of the filesystem (on
    a smaller one it took all the free space GC saw, and every page went)."""
    return min(WAL_BYTES, fs_bytes // 16)


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer can still allocate on the filesystem of `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def is_disk_full(error: BaseException | None, path: Path | None = None) -> bool:
    """Whether `error` (or what caused it) says the filesystem is out of space.

    SQLite reports a -shm it cannot extend as a generic "disk I/O error", and a -wal or -shm
    it cannot create for want of an inode as "unable to open database file": each counts when
    the filesystem of `path` is in fact (nearly) full of bytes, or has no inode left, so a
    failing disk or a missing dir is not mistaken for one.
    """
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, OSError) and error.errno in _OS_FULL:
            return True
        if isinstance(error, sqlite3.Error):
            code = getattr(error, "sqlite_errorcode", None)
            if code in _SQLITE_FULL or "database or disk is full" in str(error):
                return True
            if "disk I/O error" in str(error) and path is not None:
                return _nearly_full(path) or no_inodes(path)
            if code == sqlite3.SQLITE_CANTOPEN and path is not None:
                return no_inodes(path)
        error = error.__cause__ or error.__context__
        seen += 1
    return False


def _on_fs(path: Path) -> Path:
    """`path`, or its parent if it is not there: what stands for its filesystem."""
    return path if path.exists() else path.parent


def _nearly_full(path: Path) -> bool:
    try:
        return free_bytes(_on_fs(path)) < RESERVE_BYTES
    except OSError:
        return False


def no_inodes(path: Path) -> bool:
    """Whether the filesystem of `path` (or of its parent, if it is not there) has an inode
    table and no inode left an unprivileged writer may take."""
    try:
        total, free = inode_usage(_on_fs(path))
    except OSError:
        return False
    return total > 0 and free == 0


def release(state_dir: Path) -> int:
    """Give the reserve's blocks back to the filesystem; the bytes released (0: none held)."""
    try:
        with open_dir(state_dir, "") as dfd:
            fd = open_regular(dfd, RESERVE_FILE, os.O_WRONLY)
            try:
                held = os.fstat(fd).st_blocks * 512
                os.ftruncate(fd, 0)  # frees blocks; needs none
            finally:
                os.close(fd)
    except (FileNotFoundError, UnsafePathError):
        return 0
    if held:
        log.warning(
            "filesystem full: released the state DB's space reserve",
            extra={"state_dir": str(state_dir), "bytes": held},
        )
    return held


def keep(state_dir: Path) -> bool:
    """Allocate the reserve if it is missing or short and the filesystem has room for it and a
    quarter more (taking it must not fill the disk); True if it is in place afterwards."""
    try:
        with open_dir(state_dir, "") as dfd:
            fd = open_regular(dfd, RESERVE_FILE, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                return _allocate(fd)
            finally:
                os.close(fd)
    except (OSError, UnsafePathError) as e:
        # No inode or dir block to spare, or a planted link: the DB works without it.
        log.debug("space reserve not kept", extra={"state_dir": str(state_dir), "error": str(e)})
        return False


def _allocate(fd: int) -> bool:
    vfs = os.fstatvfs(fd)
    want = reserve_size(vfs.f_blocks * vfs.f_frsize)
    missing = want - os.fstat(fd).st_blocks * 512
    if missing <= 0:
        return True
    if vfs.f_bavail * vfs.f_frsize < missing + want // 4:  # leave some room besides it
        return False
    try:
        os.posix_fallocate(fd, 0, want)
    except OSError:
        os.ftruncate(fd, 0)  # a partial allocation would only hide free space
        return False
    return True


def shares_root_fs(state_dir: Path, root: Path) -> bool:
    """Whether the state dir is on the root's filesystem: the only one GC frees space on.
    OSError if either cannot be stat'ed."""
    return os.stat(state_dir).st_dev == os.stat(root).st_dev


def missing_bytes(state_dir: Path, root: Path) -> int:
    """How much of the state DB's room is not allocated now, if it shares the root's
    filesystem (0 otherwise): the reserve not held and the -wal file's growth to wal_room.
    GC plans as if both were taken, so the DB taking them keeps the free-space floor."""
    try:
        if not shares_root_fs(state_dir, root):
            return 0
        total = shutil.disk_usage(root).total
        held = _allocated(state_dir / RESERVE_FILE)
        wal = _allocated(state_dir / f"{DB_FILE}-wal")
    except OSError:
        return 0
    return max(0, reserve_size(total) - held) + max(0, wal_room(total) - wal)


def _allocated(path: Path) -> int:
    """Bytes of blocks the file at `path` holds (0: there is none); a link is not followed."""
    try:
        return os.stat(path, follow_symlinks=False).st_blocks * 512
    except FileNotFoundError:
        return 0


def usage_with_reserve(state_dir: Path) -> Callable[[Path], tuple[int, int, int]]:
    """shutil.disk_usage as if the reserve were allocated: what GC plans with."""

    def usage(root: Path) -> tuple[int, int, int]:
        total, used, free = shutil.disk_usage(root)
        missing = min(free, missing_bytes(state_dir, root))
        return total, used + missing, free - missing

    return usage
