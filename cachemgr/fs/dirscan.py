"""What one directory of the root holds: pages, temps and anything else, counted and sized.

Every count of a namespace or trash dir (`ls`, `status`, purge plans, the daemon's scans) comes
from `scan_usage`; every listing of the files themselves (index rows, what GC may delete) from
`list_files`. Both open the dir through `deletion.open_dir` (no symlink on the way), never
open a page (an open would look like a hit) and never follow a symlink.

`scan_usage` is the hot one (a million-page namespace, at every daemon start): the listing and
the stat of every entry run in C (`_dirscan.c`) on a few threads without the GIL, and the
format (cachemgr.backends) classifies each *name shape* once, not each file.

What the names mean is the caller's `fmt`: SGLang's HiCacheFile unless told otherwise. A
nested format's pages are found in the dirs its `Nesting` allows (cachemgr.fs.tree) and named
by their path below `rel_dir`.
"""

from __future__ import annotations

import _sqlite3
import os
import sqlite3
import stat
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from cachemgr.backends import FileFormat, FileKind
from cachemgr.formats import DEFAULT_FORMAT
from cachemgr.fs import NICE, _dirscan
from cachemgr.fs.safe import open_dir
from cachemgr.fs.tree import dir_filter, leaves
from cachemgr.layout import Layout

# stat() is a syscall with little CPU in it: two threads per core keep the kernel busy.
THREADS = max(1, min(8, 2 * len(os.sched_getaffinity(0))))


@dataclass(frozen=True)
class Usage:
    """What a scan of one directory found: pages and temps, and anything else."""

    pages: int = 0  # logical pages: the files of one page (pools, ranks) count once
    bytes: int = 0  # of all page files
    files: int = 0  # page files
    temps: int = 0
    temp_bytes: int = 0
    other: int = 0  # foreign names, subdirectories, symlinks: never deleted, never counted
    corrupt: int = 0  # page files off the usual size of their kind (torn): see usual_size
    digest: int = 0  # XOR of page_digest(name, size) over the page files: equals the index's?


class Rows(NamedTuple):
    """Where a scan also stores a row per page file, as it meets it: `sql` run on `conn`,
    bound to (name below the dir, size, mtime, key_len), an mtime later than `at` stored as
    `at`. The caller holds the transaction."""

    conn: sqlite3.Connection
    sql: str
    at: float


def scan_usage(
    layout: Layout, rel_dir: str, fmt: FileFormat = DEFAULT_FORMAT, rows: Rows | None = None
) -> Usage | None:
    """Count and size what is in <root>/<rel_dir>; None if it is absent. With `rows`, also
    store the page files' rows (NotImplementedError, before any walk, where the C scanner
    cannot reach the connection's SQLite: then `list_files` is the way)."""
    r, nest = fmt.scan, fmt.nesting
    into = rows and (rows.conn, _sqlite3.__file__, rows.sql, rows.at, fmt.key_len)
    try:
        with open_dir(layout.root, rel_dir) as fd:
            depth, dir_ok = (len(nest.levels), dir_filter(fd, nest)) if nest else (0, None)
            rules = (r.key_min, r.key_max, r.temp_lead, r.temp_hex)
            # a shape's verdict is its names' verdict (ScanRules)
            groups, other, _gone, pages = _dirscan.scan(
                fd, THREADS, rules, fmt.classify, depth, dir_ok, into, NICE
            )
    except FileNotFoundError:
        return None
    files = size = temps = temp_size = digest = corrupt = 0
    for _shape, kind, count, nbytes, group_digest, _untracked, sizes in groups:
        if kind == FileKind.PAGE:
            files, size, digest = files + count, size + nbytes, digest ^ group_digest
            usual = usual_size(sizes, count)
            corrupt += 0 if usual is None else count - sizes[usual]
        elif kind == FileKind.TEMP:
            temps, temp_size = temps + count, temp_size + nbytes
        else:
            other += count
    return Usage(pages, size, files, temps, temp_size, other, corrupt, digest)


def usual_size(sizes: Mapping[int, int], pages: int) -> int | None:
    """The size a strict majority (two at least) of `pages` pages of one kind have, if any.

    Pages of one kind (the same name after the key: model, ranks, pool) share a size, so the
    others are torn: truncated, or written with another KV layout. With no clear majority
    nobody can tell which is right, and an empty page is never the usual size.
    """
    size, count = max(((s, n) for s, n in sizes.items() if s), key=lambda sn: sn[1], default=(0, 0))
    return size if count >= 2 and count * 2 > pages else None


class Listed(NamedTuple):
    """A page or temp file of a directory, as GC and the index's rows need it."""

    kind: FileKind
    name: str
    size: int
    mtime: float
    key_len: int  # of a page file: its name's first key_len characters name its page; temps 0
    links: int = 1  # its names on the filesystem: with another, deleting it frees nothing


PAGES = frozenset({FileKind.PAGE})
TEMPS = frozenset({FileKind.TEMP})
DELETABLE = PAGES | TEMPS  # the only kinds anything may delete


def list_files(
    layout: Layout,
    rel_dir: str,
    kinds: frozenset[FileKind] = DELETABLE,
    fmt: FileFormat = DEFAULT_FORMAT,
) -> Generator[Listed, None, None]:
    """The files of these kinds in <root>/<rel_dir> (in the dirs of a nested format: named by
    their path below it) that are regular files; nothing if the dir is absent. Foreign names,
    other subdirectories and symlinks are never listed; only the names of the kinds asked for
    are stat'ed."""
    # GC's sweep for stale temps looks at a million-page dir without a regex per page (that
    # held the GIL ~1.5 s, and /metrics p99 went from 9 to 50 ms while it ran).
    try:
        with open_dir(layout.root, rel_dir) as top:
            for fd, path in leaves(top, fmt):
                yield from _list_dir(fd, path, kinds, fmt)
    except FileNotFoundError:
        return


def _list_dir(fd: int, path: str, kinds: frozenset[FileKind], fmt: FileFormat) -> Iterator[Listed]:
    temps_only = FileKind.PAGE not in kinds
    # scandir, not listdir: a million names as one list would be ~110 MB at once.
    with os.scandir(fd) as entries:
        for entry in entries:
            name = entry.name
            if temps_only and not fmt.maybe_temp(name):
                continue
            key_len = fmt.key_len(name)
            kind = FileKind.PAGE if key_len is not None else fmt.classify(name)
            if kind not in kinds:
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # deleted since listdir
            except PermissionError:
                if not path:
                    raise
                continue  # a hashed dir we may list but not search: the rest still counts
            if stat.S_ISREG(st.st_mode):
                # a nested page's key is its whole path (cachemgr.backends)
                klen = len(path) + len(name) if path and key_len else key_len or 0
                yield Listed(kind, path + name, st.st_size, st.st_mtime, klen, st.st_nlink)
