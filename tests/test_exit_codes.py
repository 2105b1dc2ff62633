"""Exit codes: declining a prompt; "not found" the same for every command (docs/exit-codes.md)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachemgr.layout import Layout
from cachemgr.state.store import Store
from tests.nsfixtures import cli, make_ns, one_line_error, snapshot
from tests.test_identity import make_model

REPO = Path(__file__).resolve().parent.parent


def on_a_terminal(args: list[str], answer: str) -> tuple[int, str]:
    """`cachemgr ARGS` with a pty as stdin and stderr (a person at a terminal) answering
    `answer` to the prompt; (exit code, what the terminal showed)."""
    primary, secondary = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cachemgr", "--log-format", "json", *args],
        stdin=secondary,
        stdout=subprocess.PIPE,
        stderr=secondary,
        cwd=REPO,
    )
    os.close(secondary)
    shown = b""
    try:
        deadline = time.monotonic() + 60
        while b"[y/N]" not in shown and time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 1)
            if ready:
                shown += os.read(primary, 4096)
        os.write(primary, answer.encode() + b"\n")
        code = proc.wait(timeout=60)
        while select.select([primary], [], [], 0.2)[0]:
            try:
                shown += os.read(primary, 4096)
            except OSError:  # EIO: the child closed its side
                break
    finally:
        os.close(primary)
        assert proc.stdout is not None
        proc.stdout.close()
    return code, shown.decode(errors="replace")


def test_answering_no_at_the_purge_prompt_purges_nothing(layout: Layout, store: Store) -> None:
    make_ns(layout, store, "a", pages=3)
    before = snapshot(layout.root / "ns")
    code, shown = on_a_terminal(["--root", str(layout.root), "purge", "--all"], "n")
    assert code == 1, shown
    assert "nothing purged" in shown
    assert snapshot(layout.root / "ns") == before


def test_answering_no_at_the_gc_prompt_deletes_nothing(layout: Layout, store: Store) -> None:
    ns = make_ns(layout, store, "a", pages=3)
    old = time.time() - 86400
    for page in layout.ns_dir(ns).iterdir():
        os.utime(page, (old, old))
    before = snapshot(layout.root / "ns")
    env_cap = ["--root", str(layout.root), "gc", "--max-bytes", "1"]
    code, shown = on_a_terminal(env_cap, "n")
    assert code == 1, shown
    assert "nothing deleted" in shown
    assert snapshot(layout.root / "ns") == before


@pytest.mark.parametrize(
    "what",
    ["root", "namespace", "instance", "model", "program", "config file", "record"],
)
def test_not_found_is_exit_1_for_every_command(tmp_path: Path, layout: Layout, what: str) -> None:
    root, model = str(layout.root), make_model(tmp_path / "model")
    launch = ["sglang", "serve", "--model-path", str(model), "--page-size", "64"]
    args = {
        "root": ["--root", str(tmp_path / "nope"), "ls"],
        "namespace": ["--root", root, "purge", "--namespace", "0123456789abcdef", "--yes"],
        "instance": ["--root", root, "purge", "--instance", "nope", "--yes"],
        "model": ["--root", root, "init", "--model-path", str(tmp_path / "no-model")],
        "program": ["--root", root, "exec", "--", "no-such-program-xyz", *launch[2:]],
        "config file": ["--config", str(tmp_path / "none.toml"), "--root", root, "ls"],
        "record": ["fingerprint", "diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")],
    }[what]
    out = cli(*args, env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": ""})
    one_line_error(out)
    assert out.returncode == 1, out.stderr


def test_the_exit_code_table_is_linked_from_the_readme() -> None:
    table = (REPO / "docs" / "exit-codes.md").read_text()
    for code in ("| 0 |", "| 1 |", "| 2 |", "| 130 |"):
        assert code in table
    assert "docs/exit-codes.md" in (REPO / "README.md").read_text()
