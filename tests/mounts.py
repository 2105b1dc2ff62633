"""A small tmpfs mounted for a test: a filesystem a test can fill (mounting needs root: CI runs
as root; elsewhere the test is skipped)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(at: Path, size: str, inodes: int | None = None) -> Iterator[Path]:
    """A tmpfs of `size` (mount's words: "2m") mounted at the new dir `at`, until the end;
    with `inodes`, that many files at most (the dir itself is one)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    at.mkdir()
    options = f"size={size}" + (f",nr_inodes={inodes}" if inodes is not None else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(at)], check=True)
    try:
        yield at
    finally:
        subprocess.run(["umount", "-l", str(at)], check=False)
