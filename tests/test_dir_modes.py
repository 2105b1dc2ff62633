"""Every dir and file cachemgr makes follows the deploy: the process umask decides the
permissions (UMask=0002 keeps the group's write), and a setgid root passes on its group and its
setgid bit. A hard-coded 0755 made the two-user deploy fail (test_deploy_two_users.py)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.ns.purge import rename_to_trash
from cachemgr.ns.registry import ensure_namespace
from cachemgr.state.store import Store
from tests.users import needs_root

GROUP = 23021  # a group of its own: inherited only through the setgid root
NS = "0123456789abcdef"


@pytest.fixture
def umask_0002() -> Iterator[None]:
    old = os.umask(0o002)
    try:
        yield
    finally:
        os.umask(old)


def modes(top: Path) -> dict[str, tuple[int, int]]:
    """(permission bits, gid) of everything below `top`, by relative path."""
    out = {}
    for here, dirs, files in os.walk(top):
        for name in dirs + files:
            st = os.lstat(os.path.join(here, name))
            out[os.path.relpath(os.path.join(here, name), top)] = (
                stat.S_IMODE(st.st_mode),
                st.st_gid,
            )
    return out


@needs_root
def test_dirs_and_files_follow_the_umask_and_the_setgid_root(
    tmp_path: Path, umask_0002: None
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    os.chown(root, 0, GROUP)
    os.chmod(root, 0o2775)
    layout = Layout.at(root)
    create_root(layout)
    with Store.open(layout.db_path) as store:
        identity = {"engine": "sglang", "kv_cache_dtype": "bfloat16"}
        ensure_namespace(layout, store, ns_id=NS, digest=NS * 2, identity=identity, now=1.0)
    trashed = rename_to_trash(layout, NS, recreate=True)  # a purge of a bound namespace
    found = modes(root)
    dirs = ["ns", f"ns/{NS}", ".trash", f".trash/{trashed}", ".cachemgr"]
    assert {d: found[d] for d in dirs} == dict.fromkeys(dirs, (0o2775, GROUP))
    files = [f"ns/{NS}.json", ".cachemgr/state.db", "CACHEDIR.TAG"]
    assert {f: found[f] for f in files} == dict.fromkeys(files, (0o664, GROUP))
