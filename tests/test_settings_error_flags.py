"""A settings error names the ways to set the value that exist: its env var, the config file,
and only the flags the CLI really has for it (a command's flag with the command)."""

from __future__ import annotations

import re

import click
import pytest

from cachemgr.cli import commands
from cachemgr.cli.context import setting_flag_text
from cachemgr.cli.main import cli, main
from cachemgr.errors import ConfigError
from cachemgr.settings import Settings, load_settings

# The group as `cachemgr` runs it: the global options and every subcommand.
CLI = click.Group("cachemgr", commands=commands.ALL, params=cli.params)


def _has_flag(path: str, flag: str) -> bool:
    """Whether `cachemgr PATH FLAG` is a real option ("" is the group's own)."""
    command: click.Command = CLI
    for name in path.split():
        assert isinstance(command, click.Group), path
        command = command.commands[name]
    return any(flag in p.opts for p in command.params if isinstance(p, click.Option))


def test_an_env_value_names_the_flag_of_the_command_that_has_it(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CACHEMGR_GC_MAX_FILES", "abc")
    with pytest.raises(SystemExit) as e:
        main(["--root", str(tmp_path), "config"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid gc_max_files (`cachemgr gc --max-files`, env CACHEMGR_GC_MAX_FILES)" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("setting", sorted(Settings.model_fields))
def test_every_setting_error_names_only_real_flags(setting: str) -> None:
    # object() is no valid value of any setting: every setting's error line is built.
    with pytest.raises(ConfigError) as e:
        load_settings(flags=setting_flag_text(CLI), **{setting: object()})
    line = str(e.value)
    where = line[line.index("(") : line.index("env CACHEMGR_")]
    named = re.findall(r"`cachemgr ([^`]*?) ?(--[\w-]+)`|\bflag (--[\w-]+)", where)
    for path, flag, global_flag in named:
        assert _has_flag(path, flag or global_flag), line
    # every mention of a flag was parsed above: none slips past in another form
    assert where.count("--") == len(named), line
