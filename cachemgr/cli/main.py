"""`cachemgr`: the command group, global options, and the one place errors become messages."""

from __future__ import annotations

import errno
import os
import sqlite3
import sys
from pathlib import Path

import click

from cachemgr import __version__
from cachemgr.cli.context import AppContext, setting_option
from cachemgr.cli.hints import no_such_option_hint
from cachemgr.doctor.finding import command_line
from cachemgr.errors import CachemgrError, StateCorrupt, StateDiskFull, StateError
from cachemgr.fs import reserve
from cachemgr.fs.root import unwritable
from cachemgr.layout import Layout
from cachemgr.settings import Settings


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    envvar="CACHEMGR_CONFIG",
    help="TOML config file (env CACHEMGR_CONFIG).",
)
# Kept as strings (click.Path would turn "" into "."): Settings rejects an empty directory.
# Not checked for access here: click's check is a usage error; the command says in one line
# what it could not do.
@setting_option("--root", setting="root", type=click.Path(readable=False))
@setting_option("--state-dir", setting="state_dir", type=click.Path(readable=False))
@setting_option(
    "--log-level", setting="log_level", type=click.Choice(["debug", "info", "warning", "error"])
)
@setting_option("--log-format", setting="log_format", type=click.Choice(["auto", "json", "text"]))
@click.version_option(__version__, "--version", prog_name="cachemgr")
@click.pass_context
def cli(ctx: click.Context, /, config_file: Path | None) -> None:
    """Keep the on-disk KV cache tier of SGLang (HiCache L3 file backend) and vLLM (fs tier)
    valid, bounded and observable.

    Settings come from flags, CACHEMGR_* environment variables and a TOML config file,
    in that order of precedence.
    """
    ctx.ensure_object(AppContext).config_file = config_file


@cli.command()
def version() -> None:
    """Print cachemgr's version."""
    click.echo(__version__)


def _register() -> None:
    """Attach the subcommands; each lives in its own module under cachemgr.cli."""
    # Imported when main() runs, not with this module: importing `cli` alone stays cheap. Every
    # run, `--help` included, imports all the commands (the help lists each one's summary).
    from cachemgr.cli import commands

    for command in commands.ALL:
        cli.add_command(command)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI, turning cachemgr errors into one line and an exit code."""
    _register()
    app = AppContext()  # kept here: an error's message may need the settings the run used
    try:
        try:
            # Without standalone mode click hands back ctx.exit(code) as a return value.
            rv = cli.main(args=argv, prog_name="cachemgr", standalone_mode=False, obj=app)
        except StateCorrupt:
            # The corrupt DB was moved aside (a warning said where): once more on a fresh DB,
            # which the command rebuilds from the disk as it opens it.
            rv = cli.main(args=argv, prog_name="cachemgr", standalone_mode=False, obj=app)
        sys.exit(rv if isinstance(rv, int) else 0)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.NoSuchOption as e:
        hint = no_such_option_hint(e, cli, sys.argv[1:] if argv is None else argv)
        # With a hint, Click's own guess ("Did you mean --reconcile-interval?") is left out.
        shown = click.NoSuchOption(e.option_name, f"{e.message} {hint}", ctx=e.ctx) if hint else e
        shown.show()
        sys.exit(shown.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("cachemgr: aborted", err=True)
        sys.exit(130)
    except CachemgrError as e:
        fix = f"; {disk_full_fix(app.loaded, None)}" if isinstance(e, StateDiskFull) else ""
        click.echo(f"cachemgr: error: {e}{fix}", err=True)
        sys.exit(e.exit_code)
    except BrokenPipeError:
        # `cachemgr ls | head`: the reader left; say nothing and don't let Python complain.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except (OSError, sqlite3.Error) as e:
        sys.exit(_os_error(e, app.loaded))
    except KeyboardInterrupt:
        sys.exit(130)


def disk_full_fix(settings: Settings | None, where: str | bytes | None) -> str:
    """How to get space back for a write that failed at `where` (the state dir if unknown):
    GC frees space on the root's filesystem only, so it is the fix only when they share it."""
    if settings is None:
        return "free space on that filesystem"
    state = settings.state_path
    path = Path(os.fsdecode(where)) if where else state
    move = " or move --state-dir" if path.is_relative_to(state) else ""
    if _filesystem(path) == _filesystem(settings.root):
        # A run frees space only down to the floors: with one at 0 it would free none, so the
        # line sets it, to its default, for that run.
        gc = ["gc", "--yes"]
        fields = Settings.model_fields
        if not (settings.gc_min_free_percent or settings.gc_min_free_bytes):
            gc += ["--min-free-percent", f"{fields['gc_min_free_percent'].default:g}"]
        if not settings.gc_min_free_inodes_percent:
            gc += ["--min-free-inodes-percent", f"{fields['gc_min_free_inodes_percent'].default:g}"]
        line = command_line(Layout.at(settings.root, settings.state_dir), *gc)
        return f"free space with `{line}` (it works without the state DB){move}"
    return (
        f"{path} is not on the root's filesystem ({settings.root}), where GC frees space: "
        f"free space on its own filesystem{move}"
    )


def _filesystem(path: Path) -> int | None:
    """The device of `path`, or of its nearest ancestor that exists."""
    for p in (path, *path.parents):
        try:
            return os.stat(p).st_dev
        except OSError:
            continue
    return None


def _os_error(e: OSError | sqlite3.Error, settings: Settings | None) -> int:
    """One line for a failure no module turned into a message; the exit code."""
    if reserve.is_disk_full(e):
        # A full disk can fail any write; it is the operator's situation, not a bug to trace.
        where = e.filename if isinstance(e, OSError) else None
        fix = disk_full_fix(settings, where)
        click.echo(f"cachemgr: error: no space left on the device: {e}; {fix}", err=True)
        return 1
    if isinstance(e, sqlite3.Error):
        click.echo(f"cachemgr: error: state DB: {e}", err=True)
        return StateError.exit_code
    # A path in a state cachemgr did not expect (a file where a dir should be, a dir this
    # user may not read, a read-only mount): say which, as a setting that points at the wrong
    # place would.
    if e.errno == errno.EROFS and e.filename:
        message = unwritable(Path(os.fsdecode(e.filename))) or f"{e.filename}: read-only filesystem"
    else:
        where = f"{e.filename}: " if e.filename else ""
        who = f" (uid {os.getuid()})" if e.errno in (errno.EACCES, errno.EPERM) else ""
        message = f"{where}{e.strerror or e}{who}"
    click.echo(f"cachemgr: error: {message}", err=True)
    return 2
