"""A filesystem's space: what GC budgets with, doctor checks and the daemon reports."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

# shutil.disk_usage, or a stand-in (the reserve's view, a test's disk): (total, used, free).
DiskUsageFn = Callable[[Path], tuple[int, int, int]]


class DiskUsage(NamedTuple):
    """Bytes of a filesystem as shutil.disk_usage gives them (free: to unprivileged users),
    and its inodes free to them when read from statvfs (None from a DiskUsageFn's triple)."""

    total: int
    used: int
    free: int
    free_inodes: int | None = None


def disk_usage(path: str | os.PathLike[str]) -> DiskUsage:
    """The filesystem `path` is on, inodes included."""
    st = os.statvfs(path)
    return DiskUsage(
        st.f_blocks * st.f_frsize,
        (st.f_blocks - st.f_bfree) * st.f_frsize,
        st.f_bavail * st.f_frsize,
        st.f_favail,
    )


def inode_usage(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(total, free to unprivileged users) inodes of the filesystem `path` is on."""
    st = os.statvfs(path)
    return st.f_files, st.f_favail


def atime_off(path: str | os.PathLike[str]) -> bool:
    """Whether the mount `path` is on never updates atime (noatime): a read leaves no trace."""
    return bool(os.statvfs(path).f_flag & os.ST_NOATIME)
