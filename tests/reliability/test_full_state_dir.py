"""A full state-DB filesystem: the hint says the fix that works where the state dir is.

`cachemgr gc --yes` frees space on the root's filesystem only; with `--state-dir` on another
filesystem it cannot help, and the hint said it anyway."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from cachemgr.fs.root import create_root
from cachemgr.layout import DB_FILE, RESERVE_FILE, Layout
from tests.nsfixtures import cli, one_line_error
from tests.reliability.conftest import fill_with_pages

INIT = [
    "init",
    "--instance",
    "a",
    "--",
    "sglang",
    "serve",
    "--model-path",
    "/m",
    "--page-size",
    "64",
]


def _no_db_and_full(layout: Layout, fill: Path) -> None:
    """The state dir without its DB or reserve, on a filesystem filled to ENOSPC."""
    create_root(layout)
    for p in layout.state_dir.iterdir():
        if p.name.startswith(DB_FILE) or p.name == RESERVE_FILE:
            p.unlink()
    fill_with_pages(fill)
    try:
        with open(fill / "last", "wb") as f:
            f.write(b"x" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    else:
        os.unlink(fill / "last")


def test_a_state_dir_on_another_full_filesystem_is_not_told_to_run_gc(
    small_fs: Path, tmp_path: Path
) -> None:
    layout = Layout.at(tmp_path / "root", small_fs / "state")
    _no_db_and_full(layout, small_fs / "junk")
    args = ["--root", str(layout.root), "--state-dir", str(layout.state_dir)]
    line = one_line_error(cli(*args, *INIT))
    assert "its filesystem is full" in line, line
    assert "gc --yes" not in line, line
    assert line.endswith(
        f"{layout.state_dir} is not on the root's filesystem ({layout.root}), where GC frees "
        "space: free space on its own filesystem or move --state-dir"
    ), line


def test_a_state_dir_on_the_roots_full_filesystem_is_told_to_run_gc(small_fs: Path) -> None:
    layout = Layout.at(small_fs / "root")
    _no_db_and_full(layout, layout.ns_root / "0123456789abcdef")
    line = one_line_error(cli("--root", str(layout.root), *INIT))
    assert "its filesystem is full" in line, line
    # (the suite's floors are 0, where a run would free nothing: the line sets them)
    gc = f"cachemgr --root {layout.root} gc --yes --min-free-percent 5 --min-free-inodes-percent 5"
    assert line.endswith(
        f"free space with `{gc}` (it works without the state DB) or move --state-dir"
    ), line
