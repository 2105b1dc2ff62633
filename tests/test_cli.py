"""The CLI as a user meets it: a real subprocess, its exit code and its stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click

from cachemgr import __version__
from cachemgr.cli import commands
from cachemgr.cli.main import cli


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "cachemgr", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=60,
    )


def test_version() -> None:
    out = run("version")
    assert out.returncode == 0
    assert out.stdout.strip() == __version__


def test_every_command_has_help() -> None:
    for command in [*commands.ALL, cli]:
        assert command.help, f"{command.name} has no help text"
        if isinstance(command, click.Group):
            for sub in command.commands.values():
                assert sub.help, f"{command.name} {sub.name} has no help text"


def assert_one_line_error(out: subprocess.CompletedProcess[str], needle: str) -> None:
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("cachemgr: error: ")
    assert needle in lines[0]


def test_unknown_env_value_is_one_line(tmp_path: Path) -> None:
    out = run("--root", str(tmp_path), "config", env={"CACHEMGR_LOG_LEVEL": "loud"})
    assert_one_line_error(out, "CACHEMGR_LOG_LEVEL")


def test_malformed_config_file_is_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("root = [unclosed\n")
    out = run("--config", str(cfg), "config")
    assert_one_line_error(out, "not valid TOML")


def test_unknown_config_key_is_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[cachemgr]\nroot = "/tmp/x"\nmax_bites = 3\n')
    out = run("--config", str(cfg), "config")
    assert_one_line_error(out, "unknown setting 'max_bites'")


def test_unwritable_root_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    out = run("--root", str(tmp_path / "f" / "r"), "config", "--check")
    assert_one_line_error(out, "cannot use root")


def test_precedence_flag_over_env_over_file(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[cachemgr]\nport = 1111\nhost = "127.0.0.2"\nlog_level = "debug"\n')
    env = {"CACHEMGR_PORT": "2222", "CACHEMGR_HOST": "127.0.0.3"}
    out = run("--config", str(cfg), "--log-level", "error", "config", "--json", env=env)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)["settings"]
    assert shown["port"] == 2222  # env beats file
    assert shown["host"] == "127.0.0.3"
    assert shown["log_level"] == "error"  # flag beats file
    assert shown["token"] is None


def test_token_is_never_printed(tmp_path: Path) -> None:
    out = run("--root", str(tmp_path), "config", env={"CACHEMGR_TOKEN": "s3cret"})
    assert out.returncode == 0
    assert "s3cret" not in out.stdout
    assert "token" in out.stdout


def test_empty_root_is_one_line_error_and_touches_nothing(tmp_path: Path) -> None:
    for args, env in ((("--root", ""), {}), ((), {"CACHEMGR_ROOT": ""})):
        out = subprocess.run(
            [sys.executable, "-m", "cachemgr", *args, "config", "--check"],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            cwd=tmp_path,
            timeout=60,
        )
        assert_one_line_error(out, "must not be empty")
    assert list(tmp_path.iterdir()) == []


def test_one_shot_commands_log_only_when_asked(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    quiet = run("--root", str(tmp_path / "r"), "gc", "--dry-run")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == "nothing to delete\n"
    assert quiet.stderr == ""
    asked = run(
        "--root", str(tmp_path / "r"), "gc", "--dry-run", env={"CACHEMGR_LOG_LEVEL": "info"}
    )
    assert asked.returncode == 0
    assert json.loads(asked.stderr.splitlines()[0])["msg"] == "gc dry run"
