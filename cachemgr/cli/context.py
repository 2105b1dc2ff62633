"""What every command receives: the global options, and the settings built from them once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from cachemgr import logs
from cachemgr.settings import Settings, load_settings


@dataclass
class AppContext:
    """What global options say; settings are built on first use so bad ones fail once."""

    config_file: Path | None
    overrides: dict[str, Any]
    _settings: Settings | None = field(default=None, repr=False)

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = load_settings(self.config_file, **self.overrides)
            # A one-shot command prints its result; its info logs would only repeat it on
            # stderr, so they show when asked for (flag, env, file). `serve` logs at the level.
            asked = "log_level" in self._settings.model_fields_set
            level = self._settings.log_level if asked else "warning"
            logs.setup(level, self._settings.log_format)
        return self._settings


pass_app = click.make_pass_decorator(AppContext)
