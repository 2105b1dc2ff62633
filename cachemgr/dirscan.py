"""What one directory of the root holds: pages, temps and anything else, counted and sized.

Every count of a namespace or trash dir (`ls`, `status`, purge plans, the daemon's scans) comes
from `scan_usage`. The listing and the stat of every entry run in C (`_dirscan.c`) on a few
threads without the GIL; Python classifies each *name shape* once (cachemgr.layout), not each
file. A scan never opens a page (an open would look like a hit) and never follows a symlink.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import dataclass

from cachemgr import _dirscan
from cachemgr.deletion import open_dir
from cachemgr.layout import PAGE_RE, TEMP_RE, Layout

# stat() is a syscall with little CPU in it: two threads per core keep the kernel busy.
THREADS = max(1, min(8, 2 * len(os.sched_getaffinity(0))))


@dataclass(frozen=True)
class Usage:
    """What a scan of one directory found: SGLang pages and temps, and anything else."""

    pages: int = 0
    bytes: int = 0  # of the pages
    temps: int = 0
    temp_bytes: int = 0
    other: int = 0  # foreign names, subdirectories, symlinks: never deleted, never counted
    corrupt: int = 0  # pages whose size is not the usual one of their pool (torn or foreign)
    digest: int = 0  # XOR of page_digest(name, size) over the pages: equals the index's or not


def scan_usage(layout: Layout, rel_dir: str) -> Usage | None:
    """Count and size what is in <root>/<rel_dir>; None if it is absent."""
    try:
        with open_dir(layout.root, rel_dir) as fd:
            groups, other, _gone = _dirscan.scan(fd, THREADS)
    except FileNotFoundError:
        return None
    pages = size = temps = temp_size = digest = 0
    pools: defaultdict[str | None, Counter[int]] = defaultdict(Counter)
    for shape, files, nbytes, group_digest, _untracked, sizes in groups:
        if page := PAGE_RE.fullmatch(shape):
            pages, size, digest = pages + files, size + nbytes, digest ^ group_digest
            pools[page.group("pool")].update(sizes)
        elif TEMP_RE.fullmatch(shape):
            temps, temp_size = temps + files, temp_size + nbytes
        else:
            other += files
    return Usage(pages, size, temps, temp_size, other, pages - _usual(pools), digest)


def _usual(pools: dict[str | None, Counter[int]]) -> int:
    """Pages of the most common non-zero size of their pool; the rest are counted corrupt."""
    return sum(max((n for s, n in sizes.items() if s), default=0) for sizes in pools.values())
