"""A flag that stands for a setting says what the setting's description says, and shows the
setting's default: one text for both, kept in `Settings`."""

from __future__ import annotations

from collections.abc import Iterator

import click
import pytest
from click.testing import CliRunner

from cachemgr.cli import commands
from cachemgr.cli.context import SettingOption
from cachemgr.cli.gc import gc
from cachemgr.cli.main import cli
from cachemgr.cli.serve import serve
from cachemgr.settings import Settings

# Flags whose text says more than their setting's, and why.
OWN_TEXT = {
    # Where `status` and `ls` ask the daemon, not where this process binds.
    ("status", "host"),
    ("status", "port"),
    ("ls", "host"),
    ("ls", "port"),
}


def setting_options() -> Iterator[tuple[str, SettingOption]]:
    """(command, option) for every setting-backed flag of the CLI, the global ones included."""
    for command in [cli, *commands.ALL]:
        subs = command.commands.values() if isinstance(command, click.Group) else [command]
        for cmd in [command, *subs] if isinstance(command, click.Group) else subs:
            for param in cmd.params:
                if isinstance(param, SettingOption):
                    yield str(cmd.name), param


def test_the_walk_finds_the_gc_and_serve_flags() -> None:
    found = {(cmd, opt.setting) for cmd, opt in setting_options()}
    assert {("gc", "gc_max_bytes"), ("serve", "port"), ("cli", "root")} <= found


@pytest.mark.parametrize(
    ("command", "option"),
    [(c, o) for c, o in setting_options() if (c, o.setting) not in OWN_TEXT],
    ids=lambda x: x if isinstance(x, str) else x.setting,
)
def test_a_setting_flag_has_its_settings_description(command: str, option: SettingOption) -> None:
    assert option.help == Settings.model_fields[option.setting].description


def test_help_shows_the_settings_default() -> None:
    out = CliRunner().invoke(gc, ["--help"], terminal_width=200)
    assert out.exit_code == 0, out.output
    tmp_ttl = Settings.model_fields["gc_tmp_ttl"].description
    assert f"{tmp_ttl}  [default: 1h]" in out.output
    assert "[default: 9477]" in CliRunner().invoke(serve, ["--help"], terminal_width=200).output
