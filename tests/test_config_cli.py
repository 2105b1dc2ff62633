"""`cachemgr config`: values as the docs write them, where each came from, a verdict for --check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from cachemgr.units import format_duration, parse_duration


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI as a process, with no CACHEMGR_* variable from the caller's environment."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CACHEMGR_")}
    return subprocess.run(
        [sys.executable, "-m", "cachemgr", *args],
        capture_output=True,
        text=True,
        env={**clean, **(env or {})},
        timeout=60,
    )


def _rows(stdout: str) -> dict[str, list[str]]:
    """`config`'s table: setting → [value, source…] (columns split on two or more spaces)."""
    rows: dict[str, list[str]] = {}
    for line in stdout.splitlines()[1:]:  # the first line is the header
        name, *rest = [cell for cell in line.split("  ") if cell.strip()]
        rows[name.strip()] = [cell.strip() for cell in rest]
    return rows


@pytest.fixture
def four_sources(tmp_path: Path) -> tuple[Path, dict[str, str], tuple[str, ...]]:
    """A config file, an env var and a flag, each setting something; the rest are defaults."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[cachemgr]\nroot = "{tmp_path / "root"}"\ngc_tmp_ttl = "90m"\nport = 1\n')
    env = {"CACHEMGR_PORT": "2222", "CACHEMGR_GC_UNBOUND_TTL": "36h"}
    return cfg, env, ("--config", str(cfg), "--log-level", "error")


def test_config_shows_durations_as_written_and_where_each_value_came_from(
    four_sources: tuple[Path, dict[str, str], tuple[str, ...]], tmp_path: Path
) -> None:
    cfg, env, flags = four_sources
    out = run(*flags, "config", env=env)
    assert out.returncode == 0, out.stderr
    assert "PT" not in out.stdout and "P7D" not in out.stdout, out.stdout
    rows = _rows(out.stdout)
    assert rows["gc_sweep_interval"] == ["1h", "default"]
    assert rows["gc_interval"] == ["1m", "default"]
    assert rows["gc_tmp_ttl"] == ["1h30m", f"file {cfg}"]
    assert rows["gc_unbound_ttl"] == ["1d12h", "env CACHEMGR_GC_UNBOUND_TTL"]
    assert rows["port"] == ["2222", "env CACHEMGR_PORT"]  # env beats the file's 1
    assert rows["log_level"] == ["error", "flag --log-level"]
    assert rows["root"] == [str(tmp_path / "root"), f"file {cfg}"]
    assert rows["state_dir"] == [str(tmp_path / "root" / ".cachemgr"), "default"]
    assert rows["token"] == ["(unset)", "default"]


def test_config_json_gives_values_and_sources(
    four_sources: tuple[Path, dict[str, str], tuple[str, ...]],
) -> None:
    cfg, env, flags = four_sources
    out = run(*flags, "config", "--json", env=env)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["config_file"] == str(cfg)
    assert shown["settings"]["gc_sweep_interval"] == "1h" and shown["settings"]["port"] == 2222
    assert shown["sources"]["gc_sweep_interval"] == "default"
    assert shown["sources"]["port"] == "env" and shown["sources"]["gc_tmp_ttl"] == "file"
    assert shown["sources"]["log_level"] == "flag"
    assert set(shown["sources"]) == set(shown["settings"])


def test_config_check_ends_with_a_verdict(tmp_path: Path) -> None:
    root = tmp_path / "root"
    out = run("--root", str(root), "config", "--check")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == (
        f"check passed: the settings are valid and the root {root} is usable"
    )
    as_json = run("--root", str(root), "config", "--check", "--json")
    assert json.loads(as_json.stdout)["check"] == "passed"


def test_config_check_failure_is_one_verdict_line(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    out = run("--root", str(tmp_path / "f" / "r"), "config", "--check")
    assert out.returncode == 2 and out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert line.startswith("cachemgr: error: check failed: cannot use root"), out.stderr


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.25, "0.25s"),
        (59, "59s"),
        (60, "1m"),
        (90, "1m30s"),
        (7200, "2h"),
        (5400, "1h30m"),
        (86400 * 7, "7d"),
        (86400 + 61, "1d1m1s"),
    ],
)
def test_format_duration_reads_back_as_the_same_duration(seconds: float, text: str) -> None:
    assert format_duration(timedelta(seconds=seconds)) == text
    assert parse_duration(text) == timedelta(seconds=seconds)
