"""The format of a dir whose manifest may be gone (a purged namespace in .trash/):
cachemgr.fs.tree.format_in, which a drain asks before its first unlink."""

from __future__ import annotations

import os
from pathlib import Path

from cachemgr.formats import DEFAULT_FORMAT
from cachemgr.fs.tree import _no_subdir, format_in
from cachemgr.vllm.fstier import VLLM_FS_TIER
from tests.gc_helpers import page
from tests.vllmtrees import write_blocks, write_folder


def format_of(d: Path) -> tuple[object, bool]:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return format_in(fd), _no_subdir(fd)
    finally:
        os.close(fd)


def test_a_flat_dir_is_sglang_s_and_a_vouched_tree_vllm_s_whatever_the_links_say(
    tmp_path: Path,
) -> None:
    """A dir with no subdir is known flat from its link count where the filesystem counts
    subdirs (a 9M-file entry was listed for vLLM folders, 26 s); a tree is never taken
    for one, and a dir beside it (a foreign one, unvouched) changes neither answer."""
    flat, tree = tmp_path / "flat", tmp_path / "tree"
    flat.mkdir()
    for i in range(50):
        (flat / page(i)).write_bytes(b"x")
    tree.mkdir()
    write_blocks(tree, write_folder(tree), 20, size=10)
    assert format_of(flat)[0] is DEFAULT_FORMAT
    assert format_of(tree) == (VLLM_FS_TIER, False)
    (flat / "a-dir").mkdir()  # not the engine's: listed now, and still flat
    assert format_of(flat) == (DEFAULT_FORMAT, False)
