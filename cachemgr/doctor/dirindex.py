"""Flat namespace dirs near their filesystem's one-dir entry limit (cachemgr.fs.dirlimit):
past it the server's stores fail with ENOSPC while bytes and inodes are free."""

from __future__ import annotations

from collections.abc import Iterable

from cachemgr.doctor.finding import Finding
from cachemgr.fs.dirlimit import DirIndex
from cachemgr.gc.policy import DIR_CAP_SHARE
from cachemgr.ns.status import NamespaceStatus

WARN_FROM = 0.8  # as the alert (CachemgrDirIndexNearlyFull) and GC's default cap
ERROR_FROM = 0.95


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
