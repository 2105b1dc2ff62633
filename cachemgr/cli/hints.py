"""What to say after Click's bare "No such option": where that option, or its setting, lives."""

from __future__ import annotations

import difflib
from collections.abc import Sequence

import click

from cachemgr.cli.context import setting_flags
from cachemgr.settings import ENV_PREFIX, Settings


def no_such_option_hint(error: click.NoSuchOption, group: click.Group, argv: Sequence[str]) -> str:
    """A sentence for an unknown flag: a global option given after the command, or a setting
    this command takes no flag for (with its env var and config key); "" when neither fits."""
    flag = error.option_name.split("=", 1)[0]
    command = error.ctx.command if error.ctx is not None else group
    if command is not group and any(flag in p.opts for p in group.params):
        return (
            f"{flag} is a global option: give it before the command, "
            f"cachemgr {_as_given(flag, argv)} {_command_path(error.ctx)} …"
        )
    setting = _setting_of(flag, group)
    if setting is None or any(p.name == setting for p in command.params):
        return ""  # not a setting, or a misspelling of this command's own flag: Click's guess
    where = f"set {ENV_PREFIX}{setting.upper()} or `{setting} = …` in the config file (--config)"
    flagged = [place for place in setting_flags(group).get(setting, []) if place[0]]
    also = f"; `cachemgr {flagged[0][0]}` takes it as {flagged[0][1]}" if flagged else ""
    name = "cachemgr" if command is group else f"`cachemgr {command.name}`"
    return f"{name} has no flag for the {setting} setting: {where}{also}"


def _command_path(ctx: click.Context | None) -> str:
    """The subcommand as typed after `cachemgr` ("fingerprint diff")."""
    names: list[str] = []
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name or ctx.command.name or "")
        ctx = ctx.parent
    return " ".join(reversed(names))


def _as_given(flag: str, argv: Sequence[str]) -> str:
    """The flag with the value the user gave it ("--root /srv/kv"), or a placeholder. The last
    one is the misplaced one: a global option given in its place comes before it."""
    for i, arg in reversed(list(enumerate(argv))):
        if arg.startswith(flag + "="):
            return arg
        if arg == flag and i + 1 < len(argv):
            return f"{flag} {argv[i + 1]}"
    return f"{flag} {flag.lstrip('-').replace('-', '_').upper()}"


def _setting_flags(group: click.Group) -> dict[str, str]:
    """Every flag name that stands for a setting somewhere, and the names settings answer to
    (--gc-max-bytes), mapped to the setting."""
    flags = {"--" + name.replace("_", "-"): name for name in Settings.model_fields}
    for command in [group, *group.commands.values()]:
        for param in command.params:
            if param.name in Settings.model_fields:
                flags.update(dict.fromkeys(param.opts, param.name))
    return flags


def _setting_of(flag: str, group: click.Group) -> str | None:
    """The setting `flag` names, exactly or by a close spelling (--max-byte)."""
    flags = _setting_flags(group)
    if flag in flags:
        return flags[flag]
    close = difflib.get_close_matches(flag, sorted(flags), n=1, cutoff=0.85)
    return flags[close[0]] if close else None
