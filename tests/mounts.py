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
def tmpfs(at: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's words: "2m") mounted at the new dir `at`, until the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    at.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(at)], check=True)
    try:
        yield at
    finally:
        subprocess.run(["umount", "-l", str(at)], check=False)
