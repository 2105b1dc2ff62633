"""`cachemgr config`: show the effective settings and where the state lives."""

from __future__ import annotations

import json

import click

from cachemgr.cli.context import AppContext, pass_app
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
@click.option("--check", is_flag=True, help="Also create the root skeleton and check it is usable.")
@pass_app
def config(app: AppContext, as_json: bool, check: bool) -> None:
    """Show the effective settings (flags > CACHEMGR_* env > config file > defaults)."""
    settings = app.settings
    if check:
        create_root(Layout.at(settings.root, settings.state_dir))
    shown = settings.model_dump(mode="json")
    shown["token"] = "**********" if settings.token else None
    shown["state_dir"] = str(settings.state_path)
    if as_json:
        click.echo(json.dumps(shown, indent=2))
        return
    width = max(map(len, shown))
    for key, value in shown.items():
        click.echo(f"{key:<{width}}  {value}")
