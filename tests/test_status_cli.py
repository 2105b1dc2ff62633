"""`cachemgr status` as people read it: a real process, 80 columns or piped, ids never cut."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cachemgr.doctor.launch import lint
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from cachemgr.sglang.args import resolve_launch_args
from cachemgr.units import human_bytes
from tests.daemon_helpers import (
    NS_A,
    NS_B,
    page_name,
    register_namespace,
    running_daemon,
    store_page,
)
from tests.nsfixtures import cli_process, one_line_error


@pytest.mark.parametrize("columns", ["80", ""])  # a narrow terminal; piped with no COLUMNS
def test_status_table_shows_whole_ids_at_80_columns(layout: Layout, columns: str) -> None:
    for ns in (NS_A, NS_B):
        d = register_namespace(layout, ns, instance=f"gpu-{ns[:4]}")
        store_page(d, page_name(1), 2_500_000)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    if columns:
        env["COLUMNS"] = columns
    # --port 1: nothing listens there, so the report comes from the disk. stdout is a pipe.
    argv = [sys.executable, "-m", "cachemgr", "--root", str(layout.root), "status", "--port", "1"]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines and max(len(line) for line in lines) <= 80, out.stdout
    for ns in (NS_A, NS_B):
        (row,) = [line for line in lines if ns in line]
        assert "2.5 MB" in row and "…" not in row, out.stdout


def test_status_and_ls_on_a_regular_file_root_are_one_line(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.write_text("not a dir")
    for command in (["status", "--port", "1"], ["ls"]):
        out = cli_process("--root", str(root), *command)
        assert out.returncode == 2, (command, out.stderr)
        assert one_line_error(out) == f"cachemgr: error: cache root {root} is not a directory"
        assert out.stdout == ""


def test_one_byte_format_for_every_command(tmp_path: Path) -> None:
    """status, gc, purge, ls and doctor share one formatter: decimal units that fit the size."""
    assert [human_bytes(n) for n in (0, 999, 1000, 2_500_000, 15.4e9, 3e15, -6000)] == [
        "0 B", "999 B", "1.0 kB", "2.5 MB", "15.4 GB", "3000.0 TB", "-6.0 kB",
    ]  # fmt: skip
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    args = resolve_launch_args(
        "sglang serve --enable-hierarchical-cache --hicache-storage-backend file "
        f"--page-size 64 --model-path {model}"
    )
    layout = Layout.at(tmp_path / "root")
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(layout.ns_root / NS_A)}
    found = lint(args, layout=layout, env=env, model_config={}, cap_bytes=2 * 10**9,
                 disk_free=lambda _: 500 * 10**6)  # fmt: skip
    (disk,) = [f for f in found if f.code == "disk-smaller-than-cap"]
    assert "has 500.0 MB free, less than the cap of 2.0 GB" in disk.message


def test_status_of_a_missing_root_is_an_error_not_an_empty_table(tmp_path: Path) -> None:
    out = cli_process("--root", str(tmp_path / "nowhere"), "status", "--port", "1")
    assert out.returncode == 1 and out.stdout == ""
    assert one_line_error(out) == (
        f"cachemgr: error: no cache root at {tmp_path / 'nowhere'} (init or serve creates it)"
    )


def test_status_of_another_root_ignores_the_daemon_serving_this_one(tmp_path: Path) -> None:
    served, other = Layout.at(tmp_path / "served"), Layout.at(tmp_path / "other")
    for lay, ns in ((served, NS_A), (other, NS_B)):
        create_root(lay)
        store_page(register_namespace(lay, ns, instance="gpu0"), page_name(1), 1000)
    with running_daemon(load_settings(root=served.root)) as dm:
        port = str(dm.daemon.port)
        mine = cli_process("--root", str(served.root), "status", "--json", "--port", port)
        theirs = cli_process("--root", str(other.root), "status", "--json", "--port", port)
    assert json.loads(mine.stdout)["source"] == "daemon"
    report = json.loads(theirs.stdout)
    assert report["source"] == "disk" and report["root"] == str(other.root)
    assert [ns["id"] for ns in report["namespaces"]] == [NS_B]
    assert f"serves {served.root}, not {other.root}; counting from disk" in theirs.stderr
