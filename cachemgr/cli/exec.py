"""`cachemgr exec`: init, then become the server with its storage dir set."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping

import click

from cachemgr.cli.context import AppContext, pass_app
from cachemgr.cli.init import describe, init_options, run_init, warn_refused
from cachemgr.cli.launch_options import LaunchRequest
from cachemgr.errors import ConfigError, NotFoundError
from cachemgr.launchenv import server_environ
from cachemgr.layout import Layout


@click.command("exec", context_settings={"allow_interspersed_args": False})
@init_options
@pass_app
def exec_(
    app: AppContext,
    launch: LaunchRequest,
    wait: bool,
    force: bool,
    plugin_values: tuple[str, ...],
) -> None:
    """Run init for a launch command, then replace this process with that command.

    The server gets SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR set to its namespace dir; its
    signals and exit code are its own (cachemgr is gone once it starts). Example:
    `cachemgr exec -- sglang serve --model-path M --page-size 64 --enable-hierarchical-cache
    --hicache-storage-backend file`. A vLLM launch (`-- vllm serve M --kv-transfer-config
    '{…}'`) gets its fs tier's root_dir rewritten to the namespace dir instead, in the form
    it was given (JSON, dotted keys; a --config file's tier is overridden on the command
    line). A program that is not found on PATH is an error (exit 1) before anything in the
    cache is touched.
    """
    if not launch.command:
        raise ConfigError("exec needs the server command after `--` (e.g. -- sglang serve …)")
    program = resolve_program(launch.command[0], os.environ)
    layout = Layout.at(app.settings.root, app.settings.state_dir)
    engine = launch.engine
    server_env = server_environ(launch.command, os.environ)
    engine.exec_refusal(launch.engine_args(), layout=layout, environ=server_env)
    run = run_init(app, launch, wait=wait, force=force, plugin_values=plugin_values)
    storage_dir = run.result.storage_dir
    warnings = engine.identity_warnings(run.identity) + engine.exec_warnings(
        launch.engine_args(), storage_dir, layout=layout, environ=server_env
    )
    for w in warnings:
        click.echo(f"cachemgr: warning: {w}", err=True)
    click.echo(describe(run.result), err=True)
    warn_refused(run.trash_refused)
    argv, env = engine.server_launch(launch.command, storage_dir, os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(program, argv, env)
    except OSError as e:
        raise ConfigError(f"cannot run {argv[0]!r}: {e.strerror or e}") from e


def resolve_program(name: str, env: Mapping[str, str]) -> str:
    """The executable `name` runs, looked up on the PATH the server will get.

    Checked before init so a typo (`sglang-typo serve …`) leaves the cache untouched instead
    of purging a namespace for a server that never starts. Not found: exit 1.
    """
    found = shutil.which(name, path=env.get("PATH", os.defpath))
    if found is None:
        raise NotFoundError(f"cannot run {name!r}: no such executable on PATH; nothing was changed")
    return found
