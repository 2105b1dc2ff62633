"""`cachemgr`: the command group, global options, and the one place errors become messages."""

from __future__ import annotations

import os
import sqlite3
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from cachemgr import __version__, logs
from cachemgr.errors import CachemgrError, StateCorrupt, StateError
from cachemgr.fs import reserve
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


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    envvar="CACHEMGR_CONFIG",
    help="TOML config file (env CACHEMGR_CONFIG).",
)
# Kept as strings (click.Path would turn "" into "."): Settings rejects an empty directory.
@click.option("--root", type=click.Path(), help="Cache root directory.")
@click.option("--state-dir", type=click.Path(), help="State DB directory.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--log-format", type=click.Choice(["auto", "json", "text"]))
@click.version_option(__version__, "--version", prog_name="cachemgr")
@click.pass_context
def cli(ctx: click.Context, /, config_file: Path | None, **overrides: Any) -> None:
    """Keep SGLang's HiCache L3 file cache valid, bounded and observable.

    Settings come from flags, CACHEMGR_* environment variables and a TOML config file,
    in that order of precedence.
    """
    ctx.obj = AppContext(config_file=config_file, overrides=overrides)


@cli.command()
def version() -> None:
    """Print cachemgr's version."""
    click.echo(__version__)


def _register() -> None:
    """Attach the subcommands; each lives in its own module under cachemgr.cli."""
    # Imported here so `cachemgr --help` stays fast and a module's import cost is paid by
    # the command that needs it.
    from cachemgr.cli import commands

    for command in commands.ALL:
        cli.add_command(command)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI, turning cachemgr errors into one line and an exit code."""
    _register()
    try:
        try:
            # Without standalone mode click hands back ctx.exit(code) as a return value.
            rv = cli.main(args=argv, prog_name="cachemgr", standalone_mode=False)
        except StateCorrupt:
            # The corrupt DB was moved aside (a warning said where): once more on a fresh DB,
            # which the command rebuilds from the disk as it opens it.
            rv = cli.main(args=argv, prog_name="cachemgr", standalone_mode=False)
        sys.exit(rv if isinstance(rv, int) else 0)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("cachemgr: aborted", err=True)
        sys.exit(130)
    except CachemgrError as e:
        click.echo(f"cachemgr: error: {e}", err=True)
        sys.exit(e.exit_code)
    except (OSError, sqlite3.Error) as e:
        # A full disk can fail any write; it is the operator's situation, not a bug to trace.
        if reserve.is_disk_full(e):
            click.echo(f"cachemgr: error: no space left on the device: {e}; "
                       "free space with `cachemgr gc --yes`", err=True)  # fmt: skip
            sys.exit(1)
        if not isinstance(e, sqlite3.Error):
            raise
        # The state DB failed in a way no module turned into a message.
        click.echo(f"cachemgr: error: state DB: {e}", err=True)
        sys.exit(StateError.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        # `cachemgr ls | head`: the reader left; say nothing and don't let Python complain.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
