"""The one place files are deleted: only page and temp files (as the caller's file format names
them), only inside the root, never through a symlink, paced, and with a dry run that reports
exactly what would go.

Directories are opened component by component from the root with O_NOFOLLOW and files are
unlinked relative to that descriptor, so a symlink planted anywhere on the way (or swapped in
while we work) makes the operation refuse instead of reaching outside the root. A nested
format's names (paths below the namespace dir, cachemgr.backends.Nesting) must fit its dir
levels and a vouched top dir; each dir's files then go as a flat dir's. Those dirs are never
removed: the engine makes a hashed dir, then opens a file in it; an rmdir between would fail it.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cachemgr.backends import FileFormat
from cachemgr.errors import UnsafePathError
from cachemgr.fs.deletecheck import (
    NO_PARENT,
    OWN_TEMPS,
    Checked,
    Names,
    Where,
    check_and_unlink,
    dir_id,
    names_of,
    still_at,
)
from cachemgr.fs.safe import open_dir
from cachemgr.fs.tree import by_dirs, may_unlink_in, orphan_identities, tree_names
from cachemgr.layout import NS_DIR, check_ns_id
from cachemgr.sglang.hicache import HICACHE_FILE

Progress = Callable[[int, int], None]  # (files so far, bytes so far)
# A name that is no longer there, with the bytes its deletion freed (None: it had vanished).
Removed = Callable[[str, int | None], None]
PART = 256  # names checked and unlinked per call into C: how often the root path is re-checked
# Unlinks at once, unpaced: on one thread the kernel's work per unlink is serialised on waits
# (journal, inode eviction); a few threads in one dir ran 1.5-10x one (bench/RESULTS.md).
THREADS = 8


@dataclass(frozen=True)
class DeleteReport:
    """What a deletion did (or, in a dry run, would do)."""

    files: int = 0
    bytes: int = 0
    vanished: int = 0  # gone before we got to it: someone else deleted it, not an error
    young: int = 0  # kept: modified more recently than min_age
    refused: tuple[str, ...] = ()  # kept: not a page/temp name, not a regular file, no access
    dry_run: bool = False

    def __add__(self, other: DeleteReport) -> DeleteReport:
        return DeleteReport(
            self.files + other.files,
            self.bytes + other.bytes,
            self.vanished + other.vanished,
            self.young + other.young,
            self.refused + other.refused,
            self.dry_run or other.dry_run,
        )


@dataclass
class Pacer:
    """Caps deletions per second: a mass delete slows the next file creates for minutes
    (FIELD_NOTES §7), so background deletion must leave room for the server's writes."""

    rate: float | None = None  # files per second; None = as fast as the disk goes
    batch: int = 256
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    _count: int = field(default=0, init=False)
    _start: float | None = field(default=None, init=False)

    def tick(self) -> None:
        """Count one deletion; every `batch` files, sleep until the rate is respected."""
        if self._start is None:
            self._start = self.clock()
        self._count += 1
        if self.rate and self._count % self.batch == 0:
            ahead = self._count / self.rate - (self.clock() - self._start)
            if ahead > 0:
                self.sleep(ahead)


def delete_files(
    root: Path,
    rel_dir: str,
    names: Iterable[str],
    *,
    dry_run: bool = False,
    min_age: float = 0.0,
    pacer: Pacer | None = None,
    progress: Progress | None = None,
    now: Callable[[], float] = time.time,
    removed: Removed | None = None,
    fmt: FileFormat = HICACHE_FILE,
) -> DeleteReport:
    """Delete the named page/temp files of <root>/<rel_dir> (paths below it for a nested
    format); anything else is refused.

    Stops (reported in `refused`) as soon as <root>/<rel_dir> is no longer the dir it was at
    the start: checked before each part of names (from the root, no link followed) and, by
    its entry in its parent, before each unlink. `removed` hears every name that is gone
    afterwards (so an index can drop it); not in a dry run. An unlink the kernel refuses (not
    a vanished file) is raised once `removed` has heard everything gone before it.
    """
    names = list(names)
    if fmt.nesting is not None:
        return _delete_nested(root, rel_dir, names, fmt, dry_run=dry_run, min_age=min_age,
                              pacer=pacer, progress=progress, now=now, removed=removed)  # fmt: skip
    paced = pacer is not None and bool(pacer.rate)
    # Unpaced, parts of PART names are unlinked on THREADS threads; paced, a part is one
    # pacer batch on one thread, so the pacer's sleeps fall between parts.
    step = min(PART, pacer.batch) if pacer is not None and paced else PART
    files = size = 0
    checked = Checked()
    ours = names_of(fmt)
    # never a path: unlinkat would walk its dirs, links and all
    checked.refused.extend((n, f"not a file name of {fmt.name}") for n in names if "/" in n)
    names = [n for n in names if "/" not in n]
    parent, _, leaf = rel_dir.rpartition("/")
    if not leaf:
        raise UnsafePathError(f"{rel_dir!r}: no directory to delete files from")
    stopped = False
    with open_dir(root, rel_dir) as fd, open_dir(root, parent) as parent_fd:
        where = Where(fd, parent_fd, leaf, dir_id(fd))
        for i in range(0, len(names), step):
            if not dry_run and not still_at(root, rel_dir, where.here):
                stopped = True
                break
            ok, stopped = check_and_unlink(
                where, names[i : i + step], min_age=min_age, now=now(),
                threads=1 if paced else THREADS, dry_run=dry_run, out=checked, ours=ours,
            )  # fmt: skip
            for name, nbytes in ok:
                if not dry_run:
                    if removed is not None:
                        removed(name, nbytes)
                    if pacer is not None:
                        pacer.tick()
                files += 1
                size += nbytes
                if progress is not None and files % 1024 == 0:
                    progress(files, size)
            if stopped or checked.error is not None:
                break
    if removed is not None and not dry_run:
        for name in checked.vanished:
            removed(name, None)
    if checked.error is not None:
        raise checked.error
    if progress is not None:
        progress(files, size)
    refused = tuple(f"{rel_dir}/{name}: {why}" for name, why in checked.refused)
    if stopped:
        refused += (f"{rel_dir}: moved or replaced while its files were deleted; stopped",)
    return DeleteReport(files, size, len(checked.vanished), checked.young, refused, dry_run)


def _delete_nested(
    root: Path, rel_dir: str, names: list[str], fmt: FileFormat, *, progress: Progress | None,
    removed: Removed | None, **flat: Any,
) -> DeleteReport:  # fmt: skip
    """delete_files for a nested format, a dir at a time; a name whose dirs do not fit the
    format, or whose top dir no identity file vouches for, is refused."""
    with open_dir(root, rel_dir) as fd:
        by_dir, bad = by_dirs(fd, names, fmt)
    bad = [f"{rel_dir}/{name}: not a file of {fmt.name} in a folder it vouches for" for name in bad]
    dry_run = bool(flat["dry_run"])
    total = DeleteReport(refused=tuple(bad), dry_run=dry_run)
    for sub, files in by_dir.items():
        try:
            may_unlink_in(root, rel_dir, sub)  # its mount, and unlinks allowed: a dry run asks too
            total += delete_files(
                root, f"{rel_dir}/{sub}", files, fmt=replace(fmt, nesting=None),
                progress=_shifted(progress, total), removed=_under(removed, sub), **flat,
            )  # fmt: skip
        except FileNotFoundError:  # the dir went, and its files with it
            if removed is not None and not dry_run:
                for name in files:
                    removed(f"{sub}/{name}", None)
            total += DeleteReport(vanished=len(files))
        except (UnsafePathError, PermissionError) as e:  # a link, a file, a dir we may not write
            total += DeleteReport(refused=(f"{rel_dir}/{sub}: {e}",))
    return total


def _shifted(progress: Progress | None, before: DeleteReport) -> Progress | None:
    return progress and (lambda f, n: progress(before.files + f, before.bytes + n))


def _under(removed: Removed | None, sub: str) -> Removed | None:
    return removed and (lambda name, size: removed(f"{sub}/{name}", size))


def delete_dir(
    root: Path,
    rel_dir: str,
    *,
    dry_run: bool = False,
    min_age: float = 0.0,
    pacer: Pacer | None = None,
    progress: Progress | None = None,
    fmt: FileFormat = HICACHE_FILE,
    now: Callable[[], float] = time.time,
) -> DeleteReport:
    """Empty <root>/<rel_dir> of page/temp files and remove it if nothing else is left.

    Used for namespaces renamed into .trash/: foreign files and subdirectories stay, reported;
    files younger than `min_age` stay too (and so does the dir). A nested format's dirs go
    too once empty (no engine writes to a renamed dir), and then each identity file whose
    blocks are all gone (only one that vouches for its own folder), and its folder.
    """
    with open_dir(root, rel_dir) as fd:
        names, dirs = tree_names(fd, fmt)
    report = delete_files(root, rel_dir, names, dry_run=dry_run, min_age=min_age, pacer=pacer,
                          progress=progress, fmt=fmt)  # fmt: skip
    if dry_run or report.refused or report.young:
        return report
    for sub in dirs:  # deepest first; one a writer or a person still uses stays
        remove_empty_dir(root, f"{rel_dir}/{sub}")
    if fmt.nesting is not None:
        with open_dir(root, rel_dir) as fd:
            folders = orphan_identities(fd, fmt.nesting)
        ident = fmt.nesting.identity_file
        ours: Names = (ident.__eq__, "an identity file")
        for folder in folders:
            with open_dir(root, f"{rel_dir}/{folder}") as fd:
                where = Where(fd, NO_PARENT, "", dir_id(fd))
                check_and_unlink(where, [ident], min_age=0, now=now(), threads=1,
                                 dry_run=False, out=Checked(), ours=ours)  # fmt: skip
            remove_empty_dir(root, f"{rel_dir}/{folder}")
    why = remove_empty_dir(root, rel_dir)
    return report + DeleteReport(refused=(why,)) if why else report


def remove_empty_dir(root: Path, rel_dir: str) -> str | None:
    """rmdir <root>/<rel_dir> (no symlinks on the way); None if gone, else why it stayed."""
    parent, _, leaf = rel_dir.rpartition("/")
    with open_dir(root, parent) as pfd:
        try:
            os.rmdir(leaf, dir_fd=pfd)
        except FileNotFoundError:
            pass
        except OSError as e:  # a writer added files meanwhile: leave it for the next run
            return f"{rel_dir}: not removed: {e.strerror}"
    return None


def delete_manifest(root: Path, ns_id: str) -> bool:
    """Remove ns/<id>.json of a namespace purged while unbound; False if it was already gone."""
    name = f"{check_ns_id(ns_id)}.json"
    with open_dir(root, NS_DIR) as fd:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{root}/ns/{name} is not a regular file; left alone")
        try:
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            return False
        return True


def delete_own_temps(
    root: Path,
    rel_dir: str,
    names: Iterable[str],
    *,
    older_than: float,
    now: Callable[[], float] = time.time,
    dry_run: bool = False,
) -> DeleteReport:
    """Delete temp files cachemgr's own atomic writes left in <root>/<rel_dir> (a kill -9
    between write and rename): only names `safefs.is_own_temp` recognises, only regular files,
    only older than `older_than` seconds (a younger one may be a write in progress)."""
    checked = Checked()
    with open_dir(root, rel_dir) as fd:
        ok, _ = check_and_unlink(
            Where(fd, NO_PARENT, "", dir_id(fd)), list(names), min_age=older_than, now=now(),
            threads=1, dry_run=dry_run, out=checked, ours=OWN_TEMPS,
        )  # fmt: skip
    if checked.error is not None:
        raise checked.error
    refused = tuple(f"{rel_dir}/{name}: {why}" for name, why in checked.refused)
    return DeleteReport(
        len(ok), sum(n for _, n in ok), len(checked.vanished), checked.young, refused, dry_run
    )
