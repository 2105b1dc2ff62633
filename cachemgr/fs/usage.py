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
