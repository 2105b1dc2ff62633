"""Atomic file writes: a temp file in the same directory, fsync, rename, fsync the directory.

A reader (SGLang's init container, a second cachemgr) sees the old file or the new one, never a
torn one, and after a crash the new one is there only if the rename reached the disk.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from cachemgr.errors import ConfigError

_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def write_atomic_at(dir_fd: int, name: str, data: bytes, *, mode: int = 0o644) -> None:
    """Replace `name` in the directory `dir_fd` with `data`, atomically and durably."""
    tmp = f".{name}.{secrets.token_hex(6)}.tmp-cachemgr"
    fd = os.open(tmp, _FILE_FLAGS, mode, dir_fd=dir_fd)
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


def write_atomic(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace the file at `path` with `data` atomically; ConfigError if it cannot be written."""
    parent = path.parent
    try:
        dir_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {parent}: {e.strerror or e}") from e
    try:
        write_atomic_at(dir_fd, path.name, data, mode=mode)
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {e.strerror or e}") from e
    finally:
        os.close(dir_fd)
