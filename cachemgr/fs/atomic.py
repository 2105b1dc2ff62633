"""Atomic file writes: a temp file in the same directory, fsync, rename, fsync the directory.

A reader (SGLang's init container, a second cachemgr) sees the old file or the new one, never a
torn one, and after a crash the new one is there only if the rename reached the disk.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from cachemgr.errors import ConfigError
from cachemgr.fs.safe import DIR_FLAGS, FILE_MODE, write_atomic_at


def write_atomic(path: Path, data: bytes | Iterable[memoryview], *, mode: int = FILE_MODE) -> None:
    """Replace the file at `path` with `data` (or these buffers in a row) atomically;
    ConfigError if it cannot be written."""
    parent = path.parent
    try:
        dir_fd = os.open(parent, DIR_FLAGS)
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {parent}: {e.strerror or e}") from e
    try:
        write_atomic_at(dir_fd, path.name, data, mode=mode)
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {e.strerror or e}") from e
    finally:
        os.close(dir_fd)
