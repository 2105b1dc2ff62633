"""`cachemgr status` as people read it: a real process, 80 columns or piped, ids never cut."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from cachemgr.sglang.args import resolve_launch_args
from cachemgr.sglang.lint import lint
from cachemgr.units import human_bytes
from tests.daemon_helpers import (
    NS_A,
    NS_B,
    page_name,
    register_namespace,
    running_daemon,
    store_page,
)
from tests.nsfixtures import cli, cli_process, one_line_error

ALL_STATUS = (
    "namespace",
    "engine",
    "model",
    "kv dtype",
    "page",
    "instances",
    "pages",
    "size",
    "reads",
    "writes",
    "hit ratio",
    "last write",
)
MUST_STAY = ("namespace", "pages", "size", "reads", "hit ratio")


def _run(
    layout: Layout, columns: str, *args: str, env: dict[str, str] | None = None
) -> tuple[list[str], str]:
    """The CLI as a process with stdout a pipe, COLUMNS set or ("") unset; lines and stdout.

    The lines are those after the title (the root path, as long as pytest makes it).
    """
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in ("COLUMNS", "LINES")}
    if columns:
        env["COLUMNS"] = columns
    argv = [sys.executable, "-m", "cachemgr", "--root", str(layout.root), *args]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    title, *lines = out.stdout.splitlines()
    assert str(layout.root) in title, out.stdout
    return lines, out.stdout


def _header(lines: list[str]) -> list[str]:
    """The column names of a rich table's header row (the first row between ┃ bars)."""
    row = next(line for line in lines if line.startswith("┃"))
    return [cell.strip() for cell in row.strip("┃").split("┃")]


def _two_namespaces(layout: Layout) -> None:
    for ns in (NS_A, NS_B):
        d = register_namespace(layout, ns, instance=f"gpu-{ns[:4]}-with-a-long-instance-name")
        store_page(d, page_name(1), 2_500_000)


# Narrow terminals (58: the note wraps at "kv dtype"); piped, no COLUMNS (80); a wide one.
@pytest.mark.parametrize("columns", ["58", "80", "", "200"])
def test_status_fits_the_width_and_keeps_the_columns_that_matter(
    layout: Layout, columns: str
) -> None:
    _two_namespaces(layout)
    # --port 1: nothing listens there, so the report comes from the disk. stdout is a pipe.
    lines, stdout = _run(layout, columns, "status", "--port", "1")
    width = int(columns or 80)
    assert max(len(line) for line in lines) <= width, stdout
    shown = _header(lines)
    assert set(MUST_STAY) <= set(shown), stdout
    for ns in (NS_A, NS_B):
        (row,) = [line for line in lines if ns in line]
        assert "2.5 MB" in row and "…" not in row, stdout
    left_out = [c for c in ALL_STATUS if c not in shown]
    if width >= 200:
        assert shown == list(ALL_STATUS) and "not shown" not in stdout, stdout
    else:  # not silently: the last line names what went and how to see it
        assert left_out, stdout
        notes = [line for line in lines if not line.startswith(("┏", "┃", "┡", "│", "└"))]
        note = " ".join(notes)
        assert f"not shown at {width} columns (--wide shows all): {', '.join(left_out)}" in note
        assert all(any(name in line for line in notes) for name in left_out), notes  # unbroken


@pytest.mark.parametrize("columns", ["58", "80"])
def test_a_nearly_full_filesystem_line_fits_the_width_too(layout: Layout, columns: str) -> None:
    # A floor of 99% makes any filesystem FULL: the longest form of the line, with the floor.
    _two_namespaces(layout)
    floor = {"CACHEMGR_GC_MIN_FREE_PERCENT": "99"}
    lines, stdout = _run(layout, columns, "status", "--port", "1", env=floor)
    assert max(len(line) for line in lines) <= int(columns), stdout
    prose = " ".join(line for line in lines if not line.startswith(("┏", "┃", "┡", "│", "└")))
    assert "filesystem: " in prose and ": FULL (GC keeps " in prose, stdout


@pytest.mark.parametrize("columns", ["80", ""])
def test_status_wide_shows_every_column_at_any_width(layout: Layout, columns: str) -> None:
    _two_namespaces(layout)
    lines, stdout = _run(layout, columns, "status", "--port", "1", "--wide")
    assert _header(lines) == list(ALL_STATUS) and "not shown" not in stdout, stdout
    (row,) = [line for line in lines if NS_A in line]
    assert f"gpu-{NS_A[:4]}-with-a-long-instance-name" in row, stdout


ALL_LS = (
    "id",
    "instances",
    "engine",
    "model",
    "kv dtype",
    "page",
    "pages",
    "size",
    "created",
    "last active",
    "state",
)


@pytest.mark.parametrize("columns", ["80", "", "200"])
def test_ls_fits_the_width(layout: Layout, columns: str) -> None:
    _two_namespaces(layout)
    lines, stdout = _run(layout, columns, "ls")
    width = int(columns or 80)
    assert max(len(line) for line in lines) <= width, stdout
    shown = _header(lines)
    assert {"id", "pages", "size", "state"} <= set(shown), stdout
    for ns in (NS_A, NS_B):
        (row,) = [line for line in lines if ns in line]
        assert "2.5 MB" in row and "bound" in row and "…" not in row, stdout
    if width >= 200:
        assert shown == list(ALL_LS) and "not shown" not in stdout, stdout
    else:
        assert "(--wide shows all)" in stdout, stdout
    wide, stdout = _run(layout, columns, "ls", "--wide")
    assert _header(wide) == list(ALL_LS), stdout


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
        "0 B",
        "999 B",
        "1.0 kB",
        "2.5 MB",
        "15.4 GB",
        "3000.0 TB",
        "-6.0 kB",
    ]
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    args = resolve_launch_args(
        "sglang serve --enable-hierarchical-cache --hicache-storage-backend file "
        f"--page-size 64 --model-path {model}"
    )
    layout = Layout.at(tmp_path / "root")
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(layout.ns_root / NS_A)}
    found = lint(
        args,
        layout=layout,
        env=env,
        model_config={},
        cap_bytes=2 * 10**9,
        disk_free=lambda _: 500 * 10**6,
    )
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


def test_status_and_ls_say_why_they_count_on_disk_when_the_daemon_is_elsewhere(
    tmp_path: Path,
) -> None:
    """A daemon indexes the root but listens on another port: the count from disk takes
    minutes at millions of pages, so the operator is told why, and how to ask the daemon."""
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    store_page(register_namespace(layout, NS_A, instance="gpu0"), page_name(1), 1000)
    quiet = cli_process("--root", str(layout.root), "status", "--port", "1")
    assert "counting from disk" not in quiet.stderr  # no daemon: nothing to explain
    with running_daemon(load_settings(root=layout.root)) as dm:
        port = str(dm.daemon.port)
        asked = cli_process("--root", str(layout.root), "status", "--json", "--port", port)
        for command in ("status", "ls"):
            out = cli_process("--root", str(layout.root), command, "--json", "--port", "1")
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["source"] == "disk"
            [line] = [ln for ln in out.stderr.splitlines() if "counting from disk" in ln]
            assert line.startswith(f"cachemgr: a daemon indexes {layout.root} (pid {os.getpid()}")
            assert line.endswith(
                "but none answered for it on 127.0.0.1:1; counting from disk"
                " (give its --port or CACHEMGR_PORT)"
            )
    assert json.loads(asked.stdout)["source"] == "daemon" and asked.stderr == ""


def test_status_without_a_daemon_counts_torn_and_foreign_files_on_disk(layout: Layout) -> None:
    """Every count is the disk's: foreign and torn files were the DB's last scan beside fresh
    page counts (0 with a torn page and a foreign file there, 1 torn after GC deleted it)."""
    d = register_namespace(layout, NS_A, instance="gpu0")
    for i in range(5):
        store_page(d, page_name(i), 4096)
    (d / page_name(5)).write_bytes(b"\x01" * 100)  # torn: off its kind's usual size
    (d / "notes.txt").write_text("hi")
    out = cli("--root", str(layout.root), "status", "--json")
    assert out.returncode == 0, out.stderr
    (ns,) = json.loads(out.stdout)["namespaces"]
    assert (ns["pages"], ns["corrupt_files"], ns["foreign_files"]) == (6, 1, 1)
