"""The dirs of a nested namespace (a format with a `Nesting`: vLLM's hashed dirs), walked
without ever following a symlink: each dir is opened with O_NOFOLLOW|O_DIRECTORY from its
parent's descriptor, and only dirs whose names fit their level are entered, never one on
another mount than the namespace dir (a filesystem or bind mount put there is not the engine's).

A top-level dir is entered only if its identity file vouches for it (`vouched`); that file is
read through `safe.read_regular` (a regular file, no link, bounded size), never written.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from contextlib import suppress

from cachemgr.backends import FileFormat, Nesting
from cachemgr.errors import UnsafePathError
from cachemgr.formats import DEFAULT_FORMAT, FORMATS
from cachemgr.fs._dirscan import mount_id
from cachemgr.fs.safe import DIR_FLAGS, open_dir_at, read_regular

IDENTITY_LIMIT = 1 << 20  # a vLLM config.json is ~1 KB; a bigger one is not the engine's

# (fd, path below the namespace dir ending in "/"): a dir holding page files, open while yielded
Leaf = tuple[int, str]
ByDir = dict[str, list[str]]  # dirs below the namespace dir -> file names in it


def vouched(ns_fd: int, nesting: Nesting) -> frozenset[str]:
    """The top-level dirs of the namespace dir `ns_fd` that are the engine's: their name fits
    the top level and their owner's identity file says so."""
    found = set()
    verdicts: dict[str, bool] = {}
    with os.scandir(ns_fd) as entries:
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False) or not nesting.dir_ok(0, entry.name):
                continue
            owner = nesting.owner(entry.name)
            if owner not in verdicts:
                verdicts[owner] = _vouches(ns_fd, owner, nesting)
            if verdicts[owner]:
                found.add(entry.name)
    return frozenset(found)


def _vouches(ns_fd: int, owner: str, nesting: Nesting) -> bool:
    return _identity(ns_fd, owner, nesting) is not None


def _identity(ns_fd: int, owner: str, nesting: Nesting) -> bytes | None:
    """The bytes of `owner`'s identity file if they vouch for it, else None."""
    try:
        # Absent, a symlink, a file, a dir mounted there: nothing vouches.
        with open_dir_at(ns_fd, owner) as fd:
            raw = read_regular(fd, nesting.identity_file, IDENTITY_LIMIT)
    except (OSError, UnsafePathError):
        return None
    return raw if nesting.vouches(owner, raw) else None


def identities(ns_fd: int) -> dict[str, tuple[str, bytes]]:
    """The identity files of namespace dir `ns_fd`, any nested format's: folder -> (file name,
    bytes), only those that vouch for their own folder."""
    found = {}
    with os.scandir(ns_fd) as entries:
        dirs = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    for nesting in (f.nesting for f in FORMATS.values() if f.nesting is not None):
        for name in dirs:
            raw = _identity(ns_fd, name, nesting)
            if raw is not None:
                found[name] = (nesting.identity_file, raw)
    return found


def dir_filter(ns_fd: int, nesting: Nesting) -> Callable[[int, bytes], bool]:
    """The scanner's dir_ok for namespace dir `ns_fd`: each level's pattern, and vouching."""
    tops = vouched(ns_fd, nesting)

    def ok(level: int, raw: bytes) -> bool:
        name = os.fsdecode(raw)
        return name in tops if level == 0 else nesting.dir_ok(level, name)

    return ok


def leaves(ns_fd: int, fmt: FileFormat) -> Iterator[Leaf]:
    """Every dir of namespace dir `ns_fd` that may hold page files, depth first; the namespace
    dir itself for a flat format. Each fd is closed once the next one is asked for."""
    if fmt.nesting is None:
        yield ns_fd, ""
        return
    ok, depth = dir_filter(ns_fd, fmt.nesting), len(fmt.nesting.levels)
    yield from _below(ns_fd, "", 0, ok, depth, mount_id(ns_fd))


def _below(
    fd: int, path: str, level: int, ok: Callable[[int, bytes], bool], depth: int, mnt: int
) -> Iterator[Leaf]:
    if level == depth:
        yield fd, path
        return
    with os.scandir(fd) as entries:
        names = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    for name in names:
        if not ok(level, os.fsencode(name)):
            continue
        try:
            child = os.open(name, DIR_FLAGS, dir_fd=fd)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.EACCES, errno.EPERM):
                continue  # gone since listed, swapped for a link, unreadable: never entered
            raise
        if mount_id(child) != mnt:  # a mount point: never entered
            os.close(child)
            continue
        try:
            yield from _below(child, f"{path}{name}/", level + 1, ok, depth, mnt)
        finally:
            with suppress(OSError):
                os.close(child)


def by_dirs(ns_fd: int, paths: list[str], fmt: FileFormat) -> tuple[ByDir, list[str]]:
    """Paths below namespace dir `ns_fd`, grouped by dir ({dirs: [file names]}), and those whose
    dirs do not fit `fmt`'s nesting or whose top dir no identity file vouches for."""
    assert fmt.nesting is not None
    tops = vouched(ns_fd, fmt.nesting)
    groups: ByDir = {}
    bad: list[str] = []
    for path in paths:
        where = fmt.split(path)
        if where is None or where[0].partition("/")[0] not in tops:
            bad.append(path)
        else:
            groups.setdefault(where[0], []).append(where[1])
    return groups, bad


def tree_chunks(ns_fd: int, fmt: FileFormat, size: int, dirs: set[str]) -> Iterator[list[str]]:
    """Every name in the dirs that may hold page files (paths below `ns_fd`), `size` at a
    time, each chunk listed when asked for (a purged dir of ten million files is not one list
    of them: a gigabyte); the dirs of the nesting met (none for a flat format) are added to
    `dirs`. A chunk's files deleted before the next is asked for do not move the names not
    listed yet (readdir's position holds)."""
    chunk: list[str] = []
    for fd, path in leaves(ns_fd, fmt):
        parts = path.rstrip("/").split("/") if path else []
        dirs |= {"/".join(parts[:i]) for i in range(1, len(parts) + 1)}
        with os.scandir(fd) as entries:
            for entry in entries:
                chunk.append(path + entry.name)
                if len(chunk) >= size:
                    yield chunk
                    chunk = []
    if chunk:
        yield chunk


def deepest_first(dirs: set[str]) -> list[str]:
    """Dirs below a namespace dir in an order to remove them once empty: children first."""
    return sorted(dirs, key=lambda d: -d.count("/"))


def format_in(fd: int) -> FileFormat:
    """The format of a dir whose manifest may be gone (a purged namespace in .trash/): a nested
    one if an identity file in it vouches for one of its dirs, else SGLang's. A wrong guess
    deletes nothing wrongly: a flat format never enters a dir, a nested one only vouched ones."""
    if _no_subdir(fd):  # (a purged flat dir of 9M files took 26 s to list for none)
        return DEFAULT_FORMAT
    for fmt in FORMATS.values():
        if fmt.nesting is not None and vouched(fd, fmt.nesting):
            return fmt
    return DEFAULT_FORMAT


def _no_subdir(fd: int) -> bool:
    """Whether the dir holds no dir, known without listing it: ext4, xfs and tmpfs count a
    dir's subdirs in its links (2 + them), and then its parent, which holds it, has 3 or more.
    Where they are not counted (btrfs says 1; an SMB mount says 2 for every dir) it is not
    known."""
    return os.fstat(fd).st_nlink == 2 and os.stat("..", dir_fd=fd).st_nlink >= 3


def orphan_identities(ns_fd: int, nesting: Nesting) -> list[str]:
    """The folders of namespace dir `ns_fd` whose identity file vouches for them and that no
    top-level dir belongs to any more (their blocks are all gone)."""
    return [d for d in unowned_dirs(ns_fd, nesting) if _vouches(ns_fd, d, nesting)]


def unowned_dirs(ns_fd: int, nesting: Nesting) -> list[str]:
    """The dirs of namespace dir `ns_fd` that no top-level block dir belongs to."""
    with os.scandir(ns_fd) as entries:
        dirs = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    owned = {nesting.owner(d) for d in dirs if nesting.dir_ok(0, d)}
    return [d for d in dirs if d not in owned]
