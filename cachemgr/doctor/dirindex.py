"""Flat namespace dirs near their filesystem's one-dir entry limit (cachemgr.fs.dirlimit):
past it the server's stores fail with ENOSPC while bytes and inodes are free."""

from __future__ import annotations

import os
from collections.abc import Iterable

from cachemgr.backends import FileKind
from cachemgr.doctor.finding import Finding
from cachemgr.errors import UnsafePathError
from cachemgr.formats import FORMATS
from cachemgr.fs.dirlimit import DirIndex
from cachemgr.fs.safe import open_dir
from cachemgr.gc.policy import DIR_CAP_SHARE
from cachemgr.layout import Layout
from cachemgr.ns.status import NamespaceStatus

WARN_FROM = 0.8  # as the alert (CachemgrDirIndexNearlyFull) and GC's default cap
ERROR_FROM = 0.95


def entries_now(layout: Layout, status: NamespaceStatus, index: DirIndex | None) -> NamespaceStatus:
    """`status` with its dir's entries counted now where that dir has an entry limit: with no
    daemon indexing the root, the state DB's counts are its last scan's (none for a dir never
    indexed, the old ones for a dir written since). Names only, no stat: seconds a million."""
    if not status.has_dir or status.files is None or status.entry_limit(index) is None:
        return status
    fmt = FORMATS[status.engine]
    kinds = dict.fromkeys(FileKind, 0)
    longest = status.longest_name
    try:
        with open_dir(layout.root, f"ns/{status.id}") as fd, os.scandir(fd) as names:
            for entry in names:  # (key_len parses by shape: 0.6 µs a name, classify 2-4)
                name = entry.name
                if fmt.key_len(name) is not None:
                    kinds[FileKind.PAGE] += 1
                    longest = max(longest, len(os.fsencode(name)))
                else:
                    kinds[fmt.classify(name)] += 1
    except (OSError, UnsafePathError):
        return status  # (lint_root says what is wrong with the dir)
    others = {"temp_files": kinds[FileKind.TEMP], "foreign_files": kinds[FileKind.FOREIGN]}
    counted = {"files": kinds[FileKind.PAGE], "longest_name": longest, **others}
    return status.model_copy(update=counted)


def _how(index: DirIndex) -> str:
    """How doctor knows the filesystem is an ext4 without large_dir."""
    if index.fstype == "overlay":
        return "assumed: the upper layer of this overlay cannot be read from here"
    return "assumed: its superblock could not be read" if index.assumed else "read"


def lint_dir_entries(statuses: Iterable[NamespaceStatus], index: DirIndex | None) -> list[Finding]:
    """A warning for each flat namespace dir at 80% of its entry limit, an error from 95%."""
    if index is None:
        return []
    found = []
    for s in statuses:
        limit = s.entry_limit(index)
        entries = s.dir_entries
        if not limit or entries is None or entries < limit * WARN_FROM:
            continue
        what = (
            f"ns {s.id}: {entries:,} entries in one dir, {entries / limit:.0%} of the about "
            f"{limit:,} an ext4 without large_dir ({_how(index)}) takes at "
            f"{index.block_size} B blocks before every store fails with ENOSPC"
        )
        fix = (
            "let GC keep it (gc_namespace_max_files unset or lower: it caps a flat namespace at "
            "80% of the limit), or `tune2fs -O large_dir` the filesystem"
        )
        others = (s.temp_files or 0) + (s.foreign_files or 0)
        if others >= limit * DIR_CAP_SHARE:  # GC's cap counts them, and cannot evict them
            fix = (
                f"{others:,} of them are temp or other files GC does not delete: evicting "
                "pages cannot bring the dir under the limit; move those out of it, or "
                "`tune2fs -O large_dir` the filesystem"
            )
        if entries >= limit * ERROR_FROM:
            found.append(Finding("error", "dir-index-full", what, fix))
        else:
            found.append(Finding("warning", "dir-index-full", what, fix))
    return found
