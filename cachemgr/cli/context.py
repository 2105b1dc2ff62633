"""What every command receives: the global options, and the settings built from them once.

Flags that stand for a setting are declared with `setting_option`: its value goes straight
into the settings overrides (flags > CACHEMGR_* env > config file > defaults), and the command
reads `app.settings` — the one way a flag is resolved against its setting, for every command.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import click
from pydantic_core import PydanticUndefined

from cachemgr import logs
from cachemgr.settings import Settings, load_settings, unknown_env_vars
from cachemgr.units import format_duration

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger(__name__)
# Names already warned about: a command run again in the same process (main()'s retry after a
# corrupt state DB) does not say it twice.
_warned_env: set[str] = set()


@dataclass
class AppContext:
    """What global options say; settings are built on first use so bad ones fail once."""

    config_file: Path | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    _settings: Settings | None = field(default=None, repr=False)

    @property
    def loaded(self) -> Settings | None:
        """The settings if a command built them (None before, or if they were invalid)."""
        return self._settings

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            ctx = click.get_current_context(silent=True)
            flags = {} if ctx is None else setting_flag_text(ctx.find_root().command)
            self._settings = load_settings(self.config_file, flags=flags, **self.overrides)
            # A one-shot command prints its result; its info logs would only repeat it on
            # stderr, so they show when asked for (flag, env, file). `serve` logs at the level.
            asked = "log_level" in self._settings.model_fields_set
            level = self._settings.log_level if asked else "warning"
            logs.setup(level, self._settings.log_format)
            if not asked:
                logs.show_progress()
            _warn_unknown_env()
        return self._settings


def _warn_unknown_env() -> None:
    for line in unknown_env_vars(os.environ):
        if line not in _warned_env:
            _warned_env.add(line)
            log.warning(line)


pass_app = click.make_pass_decorator(AppContext)


class SettingOption(click.Option):
    """A flag standing for the setting `setting`: its help is the setting's description, and
    the default it shows is the setting's own (its value stays None: given or not)."""

    def __init__(self, *args: Any, setting: str, **kwargs: Any) -> None:
        field = Settings.model_fields[setting]
        kwargs.setdefault("help", field.description)
        super().__init__(*args, **kwargs)
        self.setting = setting
        self.setting_default = _shown(field.default)

    def get_help_extra(self, ctx: click.Context) -> click.types.OptionHelpExtra:
        extra = super().get_help_extra(ctx)
        if self.setting_default is not None:
            extra["default"] = self.setting_default
        return extra


def setting_flags(command: click.Command, path: str = "") -> dict[str, list[tuple[str, str]]]:
    """(command path, shortest flag) for each setting, for every flag that sets it in `command`
    and its subcommands ("" is the group's own, global flag)."""
    found: dict[str, list[tuple[str, str]]] = {}
    for param in command.params:
        if isinstance(param, SettingOption):
            found.setdefault(param.setting, []).append((path, min(param.opts, key=len)))
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            for setting, places in setting_flags(sub, f"{path} {name}".strip()).items():
                found.setdefault(setting, []).extend(places)
    return found


def setting_flag_text(group: click.Command) -> dict[str, str]:
    """Each setting's flags as a settings error names them: "flag --root" for a global option,
    "`cachemgr gc --max-files`" for a command's (the same name is no flag of the others)."""
    return {
        setting: ", ".join(
            f"`cachemgr {path} {flag}`" if path else f"flag {flag}" for path, flag in places
        )
        for setting, places in setting_flags(group).items()
    }


def _shown(default: Any) -> str | None:
    """A setting's default as the config file writes it (None: unset, or computed at run time)."""
    if default is None or default is PydanticUndefined:
        return None
    if isinstance(default, timedelta):
        return format_duration(default)
    return str(default)


def setting_option(*flags: str, setting: str, **kwargs: Any) -> Callable[[F], F]:
    """A flag that overrides the setting named `setting`; the command does not get its value.

    Also accepted as `--<setting-with-dashes>`, the name settings errors mention. Its help is
    the setting's description (`help=` only where the flag means more than the setting: where
    `status` asks the daemon).
    """

    def override(ctx: click.Context, _param: click.Parameter, value: Any) -> None:
        if value is not None:
            ctx.ensure_object(AppContext).overrides[setting] = value

    alias = "--" + setting.replace("_", "-")
    names = [*flags, *([alias] if alias not in flags else []), setting]
    return click.option(
        *names,
        cls=SettingOption,
        setting=setting,
        callback=override,
        expose_value=False,
        default=None,
        **kwargs,
    )
