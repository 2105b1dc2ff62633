"""The dirs of a nested namespace (a format with a `Nesting`: vLLM's hashed dirs), walked
without ever following a symlink: each dir is opened with O_NOFOLLOW|O_DIRECTORY from its
parent's descriptor, and only dirs whose names fit their level are entered.

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
from cachemgr.fs.safe import DIR_FLAGS, read_regular

IDENTITY_LIMIT = 1 << 20  # a vLLM config.json is ~1 KB; a bigger one is not the engine's

# (fd, path below the namespace dir ending in "/"): a dir holding page files, open while yielded
Leaf = tuple[int, str]


def vouched(ns_fd: int, nesting: Nesting) -> frozenset[str]:
    """The top-level dirs of the namespace dir `ns_fd` that are the engine's: their name fits
    the top level and their owner's identity file says so."""
    found = set()
    verdicts: dict[str, bool] = {}
    with os.scandir(ns_fd) as entries:
        for entry in entries:
            if not nesting.dir_ok(0, entry.name) or not entry.is_dir(follow_symlinks=False):
                continue
            owner = nesting.owner(entry.name)
            if owner not in verdicts:
                verdicts[owner] = _vouches(ns_fd, owner, nesting)
            if verdicts[owner]:
                found.add(entry.name)
    return frozenset(found)


def _vouches(ns_fd: int, owner: str, nesting: Nesting) -> bool:
    try:
        fd = os.open(owner, DIR_FLAGS, dir_fd=ns_fd)
    except OSError:
        return False  # absent, a symlink, a file: nothing vouches
    try:
        raw = read_regular(fd, nesting.identity_file, IDENTITY_LIMIT)
    except (OSError, UnsafePathError):
        return False
    finally:
        os.close(fd)
    return nesting.vouches(owner, raw)


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
    yield from _below(ns_fd, "", 0, dir_filter(ns_fd, fmt.nesting), len(fmt.nesting.levels))


def _below(
    fd: int, path: str, level: int, ok: Callable[[int, bytes], bool], depth: int
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
            if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                continue  # gone since listed, or swapped for a link: never entered
            raise
        try:
            yield from _below(child, f"{path}{name}/", level + 1, ok, depth)
        finally:
            with suppress(OSError):
                os.close(child)
