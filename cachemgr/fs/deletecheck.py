"""What a deletion checks: which names it may touch and which files (the per-file checks),
and that the dir it deletes in is still where it was (the location guard). deletion.py drives
the unlinks.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cachemgr.backends import FileFormat, FileKind
from cachemgr.errors import UnsafePathError
from cachemgr.fs.safe import is_own_temp, open_dir


def dir_id(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def entry_is(parent_fd: int, leaf: str, here: tuple[int, int]) -> bool:
    """Whether `leaf` in `parent_fd` is (not a link to) the dir identified by `here`."""
    try:
        st = os.stat(leaf, dir_fd=parent_fd, follow_symlinks=False)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == here


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
    return (lambda name: fmt.classify(name) is not FileKind.FOREIGN,
            f"a page or temp file name of {fmt.name}")  # fmt: skip


@dataclass
class Checked:
    """What checking turned away (`vanished` also gets names gone by unlink time)."""

    vanished: list[str] = field(default_factory=list)
    young: int = 0
    refused: list[tuple[str, str]] = field(default_factory=list)


def check_part(
    dir_fd: int,
    names: list[str],
    min_age: float,
    now: Callable[[], float],
    out: Checked,
    ours: Names,
) -> list[tuple[str, int]]:
    """(name, size) of the names that may be deleted; the rest are tallied in `out`."""
    ok = []
    for name in names:
        verdict = check_name(dir_fd, name, min_age, now(), ours)
        if isinstance(verdict, int):
            ok.append((name, verdict))
        elif verdict == "vanished":
            out.vanished.append(name)
        elif verdict == "young":
            out.young += 1
        else:
            out.refused.append((name, verdict))
    return ok


def too_young(mtime: float, min_age: float, now: float) -> bool:
    """Whether a file modified at `mtime` is kept by the min-age rule (a future mtime is young;
    min_age 0 means no age rule at all)."""
    return min_age > 0 and now - mtime < min_age


def check_name(dir_fd: int, name: str, min_age: float, now: float, ours: Names) -> int | str:
    """The file's size if it may be deleted, else why not."""
    accepts, what = ours
    if os.sep in name or not accepts(name):
        return f"not {what}"
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return "vanished"
    except OSError as e:
        return f"cannot stat: {e.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if too_young(st.st_mtime, min_age, now):
        return "young"
    return st.st_size
