from __future__ import annotations

from pathlib import Path

import pytest

from cachemgr.errors import ConfigError, UnsafePathError
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout


def test_namespace_ids_cannot_name_paths(tmp_path: Path) -> None:
    lay = Layout.at(tmp_path)
    assert lay.ns_dir("0123456789abcdef") == tmp_path / "ns" / "0123456789abcdef"
    for bad in ["../../etc", "0123456789abcdef/..", "0123456789ABCDEF", "", "a" * 17]:
        with pytest.raises(UnsafePathError):
            lay.ns_dir(bad)


def test_root_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ConfigError, match="symlink"):
        Layout.at(tmp_path / "link")


def test_ensure_creates_skeleton_and_cachedir_tag(tmp_path: Path) -> None:
    lay = Layout.at(tmp_path / "r")
    create_root(lay)
    create_root(lay)
    assert (tmp_path / "r" / "ns").is_dir()
    assert (tmp_path / "r" / ".trash").is_dir()
    assert (tmp_path / "r" / ".cachemgr").is_dir()
    assert (tmp_path / "r" / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f59")


def test_unusable_root_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="cannot use root"):
        create_root(Layout.at(tmp_path / "file" / "root"))
