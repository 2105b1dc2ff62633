"""What a deletion checks: which names it may touch and which files (the per-file checks),
and that the dir it deletes in is still where it was (the location guard). The per-file checks
and the unlinks run in C (_unlink.c), a part of names at a time, without the GIL; deletion.py
drives the parts.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from cachemgr.backends import FileFormat, FileKind
from cachemgr.errors import UnsafePathError
from cachemgr.fs import NICE
from cachemgr.fs._unlink import unlink_batch
from cachemgr.fs.safe import is_own_temp, open_dir


def dir_id(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def dir_at(root: Path, rel_dir: str) -> tuple[int, int] | None:
    """(device, inode) of the dir at <root>/<rel_dir> now, None if nothing is there or not a
    dir (a link is not followed): compared before and after a step, tells a dir renamed away."""
    try:
        st = os.stat(root / rel_dir, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def still_at(root: Path, rel_dir: str, here: tuple[int, int]) -> bool:
    """Whether <root>/<rel_dir> is still, reached without links, the dir we delete in: a dir
    moved out of the root keeps its descriptor, and deleting through it would follow it."""
    try:
        with open_dir(root, rel_dir) as fd:
            return dir_id(fd) == here
    except (OSError, UnsafePathError):
        return False


# Which names a deletion may touch at all, and how a refusal describes them.
Names = tuple[Callable[[str], bool], str]
OWN_TEMPS: Names = (is_own_temp, "a cachemgr temp file name")


def names_of(fmt: FileFormat) -> Names:
    """A format's page and temp file names (a page told by its shape: FileFormat.key_len)."""
    return (
        lambda name: fmt.key_len(name) is not None or fmt.classify(name) is not FileKind.FOREIGN,
        f"a page or temp file name of {fmt.name}",
    )


# Why a deletion kept a file, for metrics (a bounded label): `permission` is the deploy's doing
# (a dir the deleter may not write in: another user's umask 022, chattr +i, a sticky dir of
# another owner), the others are files that are not the engine's or not where they should be.
RefusalReason = Literal["permission", "not_ours", "not_regular", "unsafe", "other"]
REFUSAL_REASONS: tuple[RefusalReason, ...] = (
    "permission",
    "not_ours",
    "not_regular",
    "unsafe",
    "other",
)
DENIED = {errno.EACCES, errno.EPERM}  # an unlink or a dir the kernel does not let us touch


class Refusal(str):
    """Why one file (or a dir of `files`) was kept: reads as its message; `reason` is the
    bounded label, `files` how many files it kept."""

    reason: RefusalReason
    files: int

    def __new__(cls, text: str, reason: RefusalReason = "other", files: int = 1) -> Refusal:
        self = super().__new__(cls, text)
        self.reason, self.files = reason, files
        return self

    def at(self, text: str) -> Refusal:
        """The same refusal with another message (the path put in front)."""
        return Refusal(text, self.reason, self.files)


def reason_of(refusal: str) -> RefusalReason:
    """The label of a refusal (`other` for a plain message)."""
    return refusal.reason if isinstance(refusal, Refusal) else "other"


def files_of(refusal: str) -> int:
    return refusal.files if isinstance(refusal, Refusal) else 1


@dataclass
class Checked:
    """What checking turned away (`vanished` also gets names gone by unlink time)."""

    vanished: list[str] = field(default_factory=list)
    young: list[str] = field(default_factory=list)  # kept: modified within min_age
    refused: list[tuple[str, Refusal]] = field(default_factory=list)
    error: OSError | None = None  # an unlink failed (not for a vanished file): the run stops
    # Of the names unlinked, those another hard link keeps (st_nlink > 1: a `cp -al` backup
    # on the same filesystem), and their size: the page is gone, no byte or inode freed.
    linked: int = 0
    linked_bytes: int = 0

    def refuse(self, name: str, why: str, reason: RefusalReason, files: int = 1) -> None:
        self.refused.append((name, Refusal(why, reason, files)))


# What _unlink.unlink_batch says of each name.
DELETED, VANISHED, YOUNG, NOT_REGULAR, STAT_ERROR, UNLINK_ERROR, NOT_REACHED, LINKED = range(8)
NO_PARENT = -1  # Where.parent_fd of a dir with no parent to check (cachemgr's own temp dirs)


@dataclass(frozen=True)
class Where:
    """The dir a deletion works in: its descriptor, and the entry (`leaf` in `parent_fd`) that
    must still be that very dir (`here`: device, inode) before each unlink."""

    fd: int
    parent_fd: int
    leaf: str
    here: tuple[int, int]

    def c_args(self) -> tuple[int, int, str, int, int]:
        """As _unlink's calls take the dir: fd, parent fd, leaf, device, inode."""
        return (self.fd, self.parent_fd, self.leaf, *self.here)


@dataclass(frozen=True)
class UnlinkRules:
    """What a file must be to be unlinked, and how the unlinks of one part run."""

    ours: Names  # the names a deletion may touch, and how to name them in a refusal
    min_age: float = 0.0  # seconds since its last change, at `now` (0: no age rule)
    now: float = 0.0
    threads: int = 1
    dry_run: bool = False

    def c_args(self) -> tuple[float, float, int, int, bool]:
        """As _unlink's calls take them, after the names: min age, now, threads, nice, dry run."""
        return (self.min_age, self.now, self.threads, NICE, self.dry_run)


def check_and_unlink(
    where: Where, names: list[str], rules: UnlinkRules, out: Checked
) -> tuple[list[tuple[str, int]], bool]:
    """Check each name and unlink those that pass (not in a dry run): (name, bytes freed) of
    those, and whether the dir left its parent's entry (the rest of the part is then not reached).

    The name's shape is checked here; in C, per file: a regular file (lstat, no link
    followed), older than `rules.min_age` (0: no age rule), the dir still in its place, then
    unlinkat relative to the dir's descriptor. The rest are tallied in `out` (an unlink that
    fails for another reason than a vanished file ends the part in `out.error`).
    """
    what = rules.ours[1]
    fits = shaped_as(names, rules.ours)
    shaped = [n for n, fit in zip(names, fits, strict=True) if fit]
    results, moved = unlink_batch(*where.c_args(), shaped, *rules.c_args())
    verdicts = iter(results)  # in the order of `shaped` (a name given twice gets two)
    ok: list[tuple[str, int]] = []
    for name, fit in zip(names, fits, strict=True):
        if fit:
            tally(name, *next(verdicts), ok, out)
        else:
            out.refuse(name, f"not {what}", "not_ours")
    return ok, moved


def shaped_as(names: list[str], ours: Names) -> list[bool]:
    """Whether each name is one `ours` accepts: a name in the dir itself (a path would have
    unlinkat walk its dirs, links and all), of the shape of the files a deletion may touch."""
    accepts = ours[0]
    return [os.sep not in n and accepts(n) for n in names]


def tally(name: str, status: int, value: int, ok: list[tuple[str, int]], out: Checked) -> None:
    """Put one name's outcome from _unlink (status, value) in `ok` (deleted: name, bytes
    freed) or `out`."""
    if status == DELETED:
        ok.append((name, value))
    elif status == LINKED:  # gone from the cache, its data kept by another link: 0 freed
        ok.append((name, 0))
        out.linked += 1
        out.linked_bytes += value
    elif status == VANISHED:
        out.vanished.append(name)
    elif status == YOUNG:
        out.young.append(name)
    elif status == NOT_REGULAR:
        out.refuse(name, "not a regular file", "not_regular")
    elif status == STAT_ERROR:
        out.refuse(name, f"cannot stat: {os.strerror(value)}", _denied_or(value, "other"))
    elif status == UNLINK_ERROR and value in DENIED:  # a dir we may not write in: kept, loudly
        out.refuse(name, f"cannot unlink: {os.strerror(value)}", "permission")
    elif status == UNLINK_ERROR and out.error is None:
        out.error = OSError(value, os.strerror(value), name)
    # else NOT_REACHED: the part stopped first (the dir moved, or an unlink failed)


def _denied_or(value: int, reason: RefusalReason) -> RefusalReason:
    return "permission" if value in DENIED else reason


def too_young(mtime: float, min_age: float, now: float) -> bool:
    """Whether a file modified at `mtime` is kept by the min-age rule (a future mtime is young;
    min_age 0 means no age rule at all)."""
    return min_age > 0 and now - mtime < min_age
