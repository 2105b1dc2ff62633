"""`cachemgr config`: show the effective settings, where each came from, and where state lives."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import click

from cachemgr.cli.context import AppContext, pass_app
from cachemgr.errors import CachemgrError, ConfigError
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.settings import ENV_PREFIX, Settings, Source, setting_sources
from cachemgr.units import format_duration


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
@click.option("--check", is_flag=True, help="Also create the root skeleton and check it is usable.")
@pass_app
def config(app: AppContext, as_json: bool, check: bool) -> None:
    """Show the effective settings (flags > CACHEMGR_* env > config file > defaults)."""
    settings = app.settings
    if check:
        try:
            create_root(Layout.at(settings.root, settings.state_dir))
        except CachemgrError as e:
            raise ConfigError(f"check failed: {e}") from e
    shown = _values(settings)
    sources = setting_sources(app.config_file, app.overrides)
    if as_json:
        out: dict[str, Any] = {
            "config_file": None if app.config_file is None else str(app.config_file),
            "settings": shown,
            "sources": sources,
        }
        if check:
            out["check"] = "passed"
        click.echo(json.dumps(out, indent=2))
        return
    rows = [("setting", "value", "from")]
    rows += [(name, _text(v), _origin(name, sources[name], app)) for name, v in shown.items()]
    widths = [max(len(row[i]) for row in rows) for i in (0, 1)]
    for name, value, origin in rows:
        click.echo(f"{name:<{widths[0]}}  {value:<{widths[1]}}  {origin}")
    if check:
        click.echo(f"check passed: the settings are valid and the root {settings.root} is usable")


def _values(settings: Settings) -> dict[str, Any]:
    """Every setting as JSON, durations as the docs write them ("2m"), the token hidden."""
    shown = settings.model_dump(mode="json")
    for name, value in settings:
        if isinstance(value, timedelta):
            shown[name] = format_duration(value)
    shown["token"] = "**********" if settings.token else None
    shown["state_dir"] = str(settings.state_path)
    return shown


def _text(value: Any) -> str:
    if value is None:
        return "(unset)"
    return '""' if value == "" else str(value)


def _origin(name: str, source: Source, app: AppContext) -> str:
    """The source with the flag, variable or file that set the value."""
    if source == "flag":
        return f"flag --{name.replace('_', '-')}"
    if source == "env":
        return f"env {ENV_PREFIX}{name.upper()}"
    return f"file {app.config_file}" if source == "file" else "default"
