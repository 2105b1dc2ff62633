"""The one place files are deleted: only page and temp files (as the caller's file format names
them), only inside the root, never through a symlink, paced, and with a dry run that reports
exactly what would go.

Directories are opened component by component from the root with O_NOFOLLOW and files are
unlinked relative to that descriptor, so a symlink planted anywhere on the way (or swapped in
while we work) makes the operation refuse instead of reaching outside the root. A nested
format's names (paths below the namespace dir, cachemgr.backends.Nesting) must fit its dir
levels and a vouched top dir; many dirs' files go in one call into C (cachemgr.fs.treeunlink).
Those dirs are never removed: the engine makes a hashed dir, then opens a file in it; an rmdir
between would fail it.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cachemgr.backends import FileFormat
from cachemgr.errors import UnsafePathError
from cachemgr.formats import DEFAULT_FORMAT
from cachemgr.fs.deletecheck import (
    NO_PARENT,
    OWN_TEMPS,
    Checked,
    Names,
    Refusal,
    UnlinkRules,
    Where,
    check_and_unlink,
    dir_id,
    names_of,
    still_at,
)
from cachemgr.fs.safe import open_dir
from cachemgr.fs.tree import by_dirs, deepest_first, orphan_identities, tree_chunks, unowned_dirs
from cachemgr.fs.treeunlink import Part, check_and_unlink_dirs
from cachemgr.layout import NS_DIR, check_ns_id

Progress = Callable[[int, int], None]  # (files so far, bytes so far)
# A name that is no longer there, with the bytes its deletion freed (None: it had vanished).
Removed = Callable[[str, int | None], None]
# Names checked and unlinked per call into C, whatever the format: how often the root path is
# re-checked, and a stop asked (Listeners.stop: a leader frozen after that check, then woken
# without the GC lease, unlinks at most this many files late).
PART = 256
# Unlinks at once, unpaced: on one thread the kernel's work per unlink is serialised on waits
# (journal, inode eviction); a few threads in one dir ran 1.5-10x one (bench/RESULTS.md).
THREADS = 8
LISTED = 1 << 16  # names of a dir being emptied listed at a time (delete_dir)


@dataclass(frozen=True)
class DeleteReport:
    """What a deletion did (or, in a dry run, would do)."""

    files: int = 0  # names unlinked
    bytes: int = 0  # bytes freed: a file another hard link keeps frees none (`linked`)
    vanished: int = 0  # gone before we got to it: someone else deleted it, not an error
    young: int = 0  # kept: modified more recently than min_age
    refused: tuple[str, ...] = ()  # kept: not a page/temp name, not a regular file, no access
    dry_run: bool = False
    stopped: bool = False  # ended early by `Listeners.stop`: the rest of the names stay
    # Of `files`, those with another hard link (st_nlink > 1: an operator's `cp -al` backup on
    # the same filesystem), and their size: unlinked, they freed no byte and no inode.
    linked: int = 0
    linked_bytes: int = 0

    def __add__(self, other: DeleteReport) -> DeleteReport:
        return DeleteReport(
            self.files + other.files,
            self.bytes + other.bytes,
            self.vanished + other.vanished,
            self.young + other.young,
            self.refused + other.refused,
            self.dry_run or other.dry_run,
            self.stopped or other.stopped,
            self.linked + other.linked,
            self.linked_bytes + other.linked_bytes,
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

    @property
    def count(self) -> int:
        """Deletions counted so far."""
        return self._count

    def owe_at_most(self, files: int) -> None:
        """Let at most `files` deletions go at once for the time this pacer sat idle: a pacer
        kept across runs otherwise banks the minutes between them (5,888 files went back to
        back at 100/s after a 60 s gap)."""
        if self.rate and self._start is not None:
            self._start = max(self._start, self.clock() - (self._count + files) / self.rate)

    def due(self) -> float:
        """Seconds until the rate allows the next deletion (0 or less: it does now)."""
        if not self.rate or self._start is None:
            return 0.0
        return self._count / self.rate - (self.clock() - self._start)

    def tick(self) -> None:
        """Count one deletion; every `batch` files, sleep until the rate is respected."""
        if self._start is None:
            self._start = self.clock()
        self._count += 1
        if self.rate and self._count % self.batch == 0:
            ahead = self.due()
            if ahead > 0:
                self.sleep(ahead)


@dataclass(frozen=True)
class Listeners:
    """What hears of each file a deletion removes (none in a dry run, but `progress`), and
    what may end it early."""

    pacer: Pacer | None = None  # ticked: sleeps when they come faster than its rate
    progress: Progress | None = None  # running totals, every 1024 files and at the end
    removed: Removed | None = None  # each name gone (so an index drops it); vanished: None
    young: Callable[[str], None] | None = None  # each name kept as modified within min_age
    # Asked before each part: true (a shutdown; in a fleet, the GC lease lost) ends the
    # deletion there. A leader paused inside a long deletion must not go on when it wakes.
    stop: Callable[[], bool] | None = None


def delete_files(
    root: Path,
    rel_dir: str,
    names: Iterable[str],
    *,
    dry_run: bool = False,
    min_age: float = 0.0,
    now: Callable[[], float] = time.time,
    fmt: FileFormat = DEFAULT_FORMAT,
    listeners: Listeners = Listeners(),
) -> DeleteReport:
    """Delete the named page/temp files of <root>/<rel_dir> (paths below it for a nested
    format, whose dirs must fit its levels and a top dir an identity file vouches for);
    anything else is refused.

    Stops (reported in `refused`) as soon as <root>/<rel_dir> is no longer the dir it was at
    the start: checked before each part of names (from the root, no link followed) and, by
    its entry in its parent (and, nested, each dir below it by its own), before each unlink.
    `removed` hears every name that is gone afterwards (so an index can drop it); not in a
    dry run. An unlink the kernel refuses (not a vanished file) is raised once `removed` has
    heard everything gone before it.
    """
    pacer = listeners.pacer
    progress = listeners.progress
    removed = listeners.removed
    paced = pacer is not None and bool(pacer.rate)
    # Unpaced, parts of PART names are unlinked on THREADS threads; paced, a part is one
    # pacer batch on one thread, so the pacer's sleeps fall between parts.
    step = min(PART, pacer.batch) if pacer is not None and paced else PART
    checked = Checked()
    ours = names_of(fmt)
    parent, _, leaf = rel_dir.rpartition("/")
    if not leaf:
        raise UnsafePathError(f"{rel_dir!r}: no directory to delete files from")
    files = size = 0
    stopped = halted = False
    with open_dir(root, rel_dir) as fd, open_dir(root, parent) as parent_fd:
        where = Where(fd, parent_fd, leaf, dir_id(fd))
        parts, unlink = _parts(fd, list(names), fmt, step, checked)
        for part in parts:
            if listeners.stop is not None and listeners.stop():
                halted = True
                break
            if not dry_run and not still_at(root, rel_dir, where.here):
                stopped = True
                break
            rules = UnlinkRules(ours, min_age, now(), 1 if paced else THREADS, dry_run)
            ok, stopped = unlink(where, part, rules, checked)
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
        # Moved or replaced, unless emptied: then another deletion of the same dir (a second
        # drain of one trash entry, on this node or another) finished it and removed it.
        stopped = stopped and not _emptied(fd)
    if removed is not None and not dry_run:
        for name in checked.vanished:
            removed(name, None)
    if checked.error is not None:
        raise checked.error
    if progress is not None:
        progress(files, size)
    refused = tuple(why.at(f"{rel_dir}/{name}: {why}") for name, why in checked.refused)
    if stopped:
        refused += (Refusal(_moved(rel_dir), "unsafe"),)
    if listeners.young is not None:
        for name in checked.young:
            listeners.young(name)
    vanished, young = len(checked.vanished), len(checked.young)
    return DeleteReport(
        files,
        size,
        vanished,
        young,
        refused,
        dry_run,
        stopped=halted,
        linked=checked.linked,
        linked_bytes=checked.linked_bytes,
    )


def _emptied(fd: int) -> bool:
    """Whether the dir open as `fd` holds nothing any more (or was removed: then it did not)."""
    try:
        return not os.listdir(fd)
    except FileNotFoundError:
        return True


def _parts(
    fd: int, names: list[str], fmt: FileFormat, step: int, checked: Checked
) -> tuple[Iterator[Any], Callable[..., tuple[list[tuple[str, int]], bool]]]:
    """The parts of `names` to unlink in turn, and what unlinks one: names of the dir itself
    (never a path: unlinkat would walk its dirs, links and all), or a nested format's dirs
    with their names, in order of their paths (neighbours share their upper dirs' opens)."""
    if fmt.nesting is None:
        why = f"not a file name of {fmt.name}"
        for n in names:
            if "/" in n:
                checked.refuse(n, why, "not_ours")
        names = [n for n in names if "/" not in n]
        return (names[i : i + step] for i in range(0, len(names), step)), check_and_unlink
    by_dir, bad = by_dirs(fd, names, fmt)
    why = f"not a file of {fmt.name} in a folder it vouches for"
    for name in bad:
        checked.refuse(name, why, "not_ours")
    return _dir_parts(sorted(by_dir.items()), step), check_and_unlink_dirs


def _dir_parts(dirs: list[tuple[str, list[str]]], step: int) -> Iterator[Part]:
    part: Part = []
    count = 0
    for sub, files in dirs:
        part.append((sub, files))
        count += len(files)
        if count >= step:
            yield part
            part, count = [], 0
    if part:
        yield part


def delete_dir(
    root: Path,
    rel_dir: str,
    *,
    dry_run: bool = False,
    min_age: float = 0.0,
    fmt: FileFormat = DEFAULT_FORMAT,
    now: Callable[[], float] = time.time,
    listeners: Listeners = Listeners(),
) -> DeleteReport:
    """Empty <root>/<rel_dir> of page/temp files and remove it if nothing else is left.

    Used for namespaces renamed into .trash/: foreign files and subdirectories stay, reported;
    files younger than `min_age` stay too (and so does the dir). A nested format's dirs go
    too once empty (no engine writes to a renamed dir), and then each identity file whose
    blocks are all gone (only one that vouches for its own folder), and its folder.
    `listeners` as delete_files'; stopped by one, the dir and the rest of its files stay.
    """
    dirs: set[str] = set()
    report = DeleteReport(dry_run=dry_run)
    with open_dir(root, rel_dir) as fd:
        for names in tree_chunks(fd, fmt, LISTED, dirs):
            report += delete_files(
                root,
                rel_dir,
                names,
                dry_run=dry_run,
                min_age=min_age,
                fmt=fmt,
                listeners=_after(listeners, report),
            )
            if report.stopped or _moved(rel_dir) in report.refused:
                break  # halted, or the dir moved or replaced: the rest stays
    if dry_run or report.stopped or report.refused or report.young:
        return report
    try:
        why = _remove_dirs(root, rel_dir, deepest_first(dirs), fmt, now)
    except FileNotFoundError:  # another deletion of it removed it first: what this one
        return report  # deleted is still its to report (and audit)
    return report + DeleteReport(refused=(why,)) if why else report


def _moved(rel_dir: str) -> str:
    return f"{rel_dir}: moved or replaced while its files were deleted; stopped"


def _after(listeners: Listeners, before: DeleteReport) -> Listeners:
    """`listeners` for a chunk of a deletion, its running totals counted from `before`'s."""
    progress = listeners.progress
    if progress is None or not before.files:
        return listeners
    return replace(listeners, progress=lambda f, b: progress(before.files + f, before.bytes + b))


def _remove_dirs(
    root: Path, rel_dir: str, dirs: list[str], fmt: FileFormat, now: Callable[[], float]
) -> str | None:
    """delete_dir's end, once its files are gone: its empty dirs, then (nested) each identity
    file whose blocks are all gone and its folder, then the dir; why it stayed, if it did."""
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
                check_and_unlink(where, [ident], UnlinkRules(ours, now=now()), Checked())
            remove_empty_dir(root, f"{rel_dir}/{folder}")
        # A folder whose identity file another deletion of this dir took meanwhile (it was
        # not listed as vouched for above) is empty: an rmdir, which loses nothing.
        with open_dir(root, rel_dir) as fd:
            for folder in unowned_dirs(fd, fmt.nesting):
                remove_empty_dir(root, f"{rel_dir}/{folder}")
    return remove_empty_dir(root, rel_dir)


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


def sweep_own_temps(where: Path, kind: Names, *, older_than: float) -> DeleteReport:
    """Delete the temp files of `kind` a killed process left in dir `where` (its own entries
    only, nothing followed), as `delete_own_temps` does."""
    with open_dir(where, "") as fd, os.scandir(fd) as entries:
        names = [e.name for e in entries if kind[0](e.name)]
    if not names:
        return DeleteReport()
    return delete_own_temps(where, "", names, older_than=older_than, kind=kind)


def delete_own_temps(
    root: Path,
    rel_dir: str,
    names: Iterable[str],
    *,
    older_than: float,
    now: Callable[[], float] = time.time,
    dry_run: bool = False,
    kind: Names = OWN_TEMPS,
) -> DeleteReport:
    """Delete temp files cachemgr's own atomic writes left in <root>/<rel_dir> (a kill -9
    between write and rename): only names `kind` recognises (`safefs.is_own_temp`'s unless
    told), only regular files, only older than `older_than` seconds (a younger one may be a
    write in progress)."""
    checked = Checked()
    with open_dir(root, rel_dir) as fd:
        rules = UnlinkRules(kind, min_age=older_than, now=now(), dry_run=dry_run)
        ok, _ = check_and_unlink(Where(fd, NO_PARENT, "", dir_id(fd)), list(names), rules, checked)
    if checked.error is not None:
        raise checked.error
    refused = tuple(why.at(f"{rel_dir}/{name}: {why}") for name, why in checked.refused)
    return DeleteReport(
        len(ok),
        sum(n for _, n in ok),
        len(checked.vanished),
        len(checked.young),
        refused,
        dry_run,
        linked=checked.linked,
        linked_bytes=checked.linked_bytes,
    )
