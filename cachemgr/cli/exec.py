"""`cachemgr exec`: init, then become the server with its storage dir set."""

from __future__ import annotations

import os
import sys

import click

from cachemgr.cli.init import describe, init_options, run_init, warn_refused
from cachemgr.cli.launch_options import LaunchRequest
from cachemgr.cli.main import AppContext, pass_app
from cachemgr.errors import ConfigError
from cachemgr.prelaunch import STORAGE_DIR_ENV, OnChange


@click.command("exec", context_settings={"allow_interspersed_args": False})
@init_options
@pass_app
def exec_(
    app: AppContext,
    launch: LaunchRequest,
    instance: str | None,
    on_change: OnChange | None,
    wait: bool,
) -> None:
    """Run init for a launch command, then replace this process with that command.

    The server gets SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR set to its namespace dir; its
    signals and exit code are its own (cachemgr is gone once it starts). Example:
    `cachemgr exec -- sglang serve --model-path M --page-size 64 --enable-hierarchical-cache
    --hicache-storage-backend file`.
    """
    if not launch.command:
        raise ConfigError("exec needs the server command after `--` (e.g. -- sglang serve …)")
    run = run_init(app, launch, instance=instance, on_change=on_change, wait=wait)
    for c in run.conflicts:
        if c.beats_env and not c.ours:
            raise ConfigError(
                f"{c.source} is set to {c.path}; exec would replace it with "
                f"{run.result.storage_dir}: unset it (cachemgr owns the storage dir)"
            )
        if not c.beats_env:
            click.echo(
                f"cachemgr: warning: {c.source} {c.path} is ignored: {STORAGE_DIR_ENV} "
                "set by cachemgr takes precedence in SGLang",
                err=True,
            )
    click.echo(describe(run.result), err=True)
    warn_refused(run.trash_refused)
    env = {**os.environ, STORAGE_DIR_ENV: str(run.result.storage_dir)}
    argv = list(launch.command)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        raise ConfigError(f"cannot run {argv[0]!r}: {e.strerror or e}") from e
