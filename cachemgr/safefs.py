"""Opening directories and files below a base dir (the root, or the state dir) without ever
leaving it: the one primitive every read, write and delete of cachemgr goes through.

Directories are opened component by component from the base with O_NOFOLLOW, and files
relative to that descriptor with O_NOFOLLOW and O_NONBLOCK, then checked with fstat: a symlink
planted anywhere on the way (or swapped in while we work) is refused instead of followed, and a
FIFO or device is refused instead of blocking us for ever.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cachemgr.errors import UnsafePathError

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_TEMP_SUFFIX = ".tmp-cachemgr"  # write_atomic_at's temp names: .<name>.<12 hex>.tmp-cachemgr
_OWN_TEMP_RE = re.compile(r"\.[^/\x00]+\.[0-9a-f]{12}" + re.escape(_TEMP_SUFFIX))


@contextmanager
def open_dir(base: Path, rel: str) -> Iterator[int]:
    """A descriptor for <base>/<rel>, refusing '..', absolute parts and symlinks on the way."""
    parts = Path(rel).parts
    if Path(rel).is_absolute() or any(p in ("..", ".") for p in parts):
        raise UnsafePathError(f"{rel!r} is not a plain path below {base}")
    fd = _open_nofollow(str(base), None, base)
    try:
        for part in parts:
            child = _open_nofollow(part, fd, base / rel)
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _open_nofollow(name: str, dir_fd: int | None, shown: Path) -> int:
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePathError(f"{shown}: a symlink or non-directory on the way") from e
        raise


def open_regular(dir_fd: int, name: str, flags: int, mode: int = 0o644) -> int:
    """Open `name` in `dir_fd` only if it is (or is created as) a regular file; never follows a
    symlink, never blocks on a FIFO. UnsafePathError for anything else."""
    if os.sep in name or name in ("", ".", ".."):
        raise UnsafePathError(f"{name!r} is not a plain file name")
    try:
        fd = os.open(name, flags | _FILE_FLAGS, mode, dir_fd=dir_fd)
    except OSError as e:
        # ELOOP: a symlink; ENXIO: a FIFO with no reader (write side); EISDIR, ENOTDIR.
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENOTDIR):
            raise UnsafePathError(f"{name}: a symlink or not a regular file; left alone") from e
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePathError(f"{name}: not a regular file; left alone")
    return fd


def read_regular(dir_fd: int, name: str, limit: int) -> bytes:
    """The bytes of regular file `name` in `dir_fd`; UnsafePathError if it is not one or is
    larger than `limit` bytes (it is never read past the limit)."""
    fd = open_regular(dir_fd, name, os.O_RDONLY)
    try:
        data = os.read(fd, limit + 1)
        chunks = [data]
        while data and sum(map(len, chunks)) <= limit:
            data = os.read(fd, limit + 1 - sum(map(len, chunks)))
            chunks.append(data)
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if len(raw) > limit:
        raise UnsafePathError(f"{name}: larger than {limit} bytes; left alone")
    return raw


def write_atomic_at(dir_fd: int, name: str, data: bytes, *, mode: int = 0o644) -> None:
    """Replace `name` in `dir_fd` with `data`, atomically and durably: a temp file in the same
    dir, fsync, rename (which replaces a planted symlink itself, never its target), fsync dir."""
    tmp = f".{name}.{secrets.token_hex(6)}{_TEMP_SUFFIX}"
    fd = open_regular(dir_fd, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        # Our own temp file, never a page: the one unlink that is not deletion.py's.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)


def is_own_temp(name: str) -> bool:
    """Whether `name` is a temp file write_atomic_at left behind (a kill -9 mid-write): exactly
    its shape, so that GC, which deletes these, never takes a look-alike."""
    return _OWN_TEMP_RE.fullmatch(name) is not None
