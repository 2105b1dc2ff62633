"""`cachemgr init`: the step before `sglang serve` / `vllm serve` — the right namespace dir,
purged on change."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from cachemgr import engines
from cachemgr.cli import envfile
from cachemgr.cli.common import drain_with_progress
from cachemgr.cli.context import AppContext, pass_app, setting_option
from cachemgr.cli.launch_options import LaunchRequest, launch_options
from cachemgr.errors import ConfigError
from cachemgr.fs.atomic import write_atomic
from cachemgr.identity.record import Digested
from cachemgr.launchenv import server_environ
from cachemgr.layout import Layout
from cachemgr.ns import init as ns_init
from cachemgr.ns.init import InitRun, engine_missing
from cachemgr.ns.prelaunch import InitResult
from cachemgr.ns.root import created_layout
from cachemgr.units import human_bytes

F = TypeVar("F", bound=Callable[..., Any])


def init_options(f: F) -> F:
    """The options `init` and `exec` share, plus the identity options and `-- LAUNCH_CMD…`."""
    decorators = [
        launch_options,
        click.option(
            "--wait/--no-wait",
            default=True,
            help="Delete a purged namespace's files before returning (default), or leave them "
            "in .trash/ for the daemon or the next run.",
        ),
        setting_option(
            "--on-change",
            setting="on_change",
            type=click.Choice(["purge", "retain"]),
        ),
        setting_option(
            "--instance",
            setting="instance",
            metavar="NAME",
        ),
        click.option(
            "--force",
            is_flag=True,
            help="Purge the old namespace even if a running process on this host still uses "
            "it as its storage dir (another server under the same instance name).",
        ),
        click.option(
            "--plugin-value",
            "plugin_values",
            multiple=True,
            metavar="NAME",
            help="A launch value a plugin of the server's engine registers (vLLM: a "
            "--quantization or --load-format it does not ship), taken instead of refused as "
            "a typo. Repeat for several.",
        ),
    ]
    for deco in decorators:
        f = deco(f)
    return f


def run_init(
    app: AppContext,
    launch: LaunchRequest,
    *,
    wait: bool,
    force: bool,
    plugin_values: tuple[str, ...],
) -> InitRun:
    """Check the launch, create the root, compute the identity, init its namespace
    (cachemgr.ns.init). A launch refused here leaves the root as it was (or absent)."""
    settings = app.settings
    if launch.command:
        launch.engine.check_launch(
            launch.engine_args(),
            launch.command,
            os.environ,
            plugin_values=frozenset(plugin_values),
        )
    layout = created_layout(settings)
    run = ns_init.run_init(
        layout,
        launch.compute_identity(settings, writes=True),
        instance=settings.instance,
        on_change=settings.on_change,
        force=force,
        drain=functools.partial(drain_with_progress, actor="cli") if wait else None,
    )
    warning = version_warning(run.identity)
    if warning is not None and not run.engine_missing_told:
        click.echo(f"cachemgr: warning: {warning}", err=True)
    return run


def version_warning(identity: Digested) -> str | None:
    """What to say when no installed engine gave the identity its version, with the fix."""
    if not engine_missing(identity):
        return None
    engine = engines.for_record(identity)
    name, option = engine.label, engine.version_option
    if identity.engine_version_from == "namespace":
        return (
            f"{name} is not installed here; using version {identity.engine_version} of the "
            f"instance's namespace (pass {option} to be explicit)"
        )
    return (
        f"{name} is not installed here, so the identity's {name} version is 'unknown'; pass "
        f"{option} (e.g. {engine.version_example}) so init and exec agree"
    )


def describe(result: InitResult) -> str:
    """The one line a person reads: what happened, and why."""
    ns = f"ns {result.ns_id}"
    if result.outcome == "created":
        return f"created {ns} for instance {result.instance}: {result.storage_dir}"
    if result.outcome == "joined":
        return f"using existing {ns} for instance {result.instance}: {result.storage_dir}"
    if result.outcome == "unchanged":
        again = " (its dir was missing: recreated empty)" if result.created_dir else ""
        return f"identity unchanged: {ns}, nothing to do{again}"
    shown = "; ".join(result.changes[:2])
    if len(result.changes) > 2:
        shown += f"; +{len(result.changes) - 2} more"
    old = f"ns {result.previous_ns} ({result.old_pages:,} pages, {human_bytes(result.old_bytes)})"
    if result.old_action == "purged":
        what = f"purged {old}"
    elif result.old_action == "kept":
        what = f"kept {old}, still used by {', '.join(result.old_users)}"
    else:
        what = f"retained {old} for a switch back"
    return f"identity changed ({shown}): {what}; now {ns}"


def env_values(launch: LaunchRequest, run: InitRun) -> dict[str, str]:
    """The variables init hands the namespace dir in, as the launch's engine reads it."""
    return launch.engine.server_env(launch.command, run.result.storage_dir, os.environ)


def env_lines(launch: LaunchRequest, run: InitRun) -> str:
    return "".join(f"{k}={shlex.quote(v)}\n" for k, v in env_values(launch, run).items())


@click.command("init")
@init_options
@click.option(
    "--print-env",
    is_flag=True,
    help="Print the variables that hand the server its namespace dir on stdout: "
    + "; ".join(f"for {e.label} {'=… and '.join(e.server_env_vars)}=…" for e in engines.ENGINES)
    + ".",
)
@click.option(
    "--env-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write what --print-env prints to this file (atomically, under a header line), e.g. "
    "for an initContainer; only a file init wrote is replaced.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@pass_app
def init(
    app: AppContext,
    launch: LaunchRequest,
    wait: bool,
    force: bool,
    plugin_values: tuple[str, ...],
    print_env: bool,
    env_file: Path | None,
    as_json: bool,
) -> None:
    """Prepare the cache for a server: its identity's namespace dir, purged if it changed.

    Pass the SGLang launch command after `--` (or the identity options); the namespace dir
    is what SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR must name for the server. For a vLLM
    launch (`-- vllm serve M … --kv-transfer-config '{…}'`) it is what the fs tier's root_dir
    must name; `--json` prints the launch rewritten that way ("command").
    """
    if env_file is not None:  # before anything is made, or a namespace purged
        if not env_file.parent.is_dir():
            raise ConfigError(f"--env-file {env_file}: {env_file.parent} is not a directory")
        envfile.check_outside(env_file, Layout.at(app.settings.root, app.settings.state_dir))
        envfile.check_replaceable(env_file)
    run = run_init(app, launch, wait=wait, force=force, plugin_values=plugin_values)
    hands_env = print_env or env_file is not None
    engine = launch.engine
    storage_dir = run.result.storage_dir
    warnings = engine.identity_warnings(run.identity) + engine.init_warnings(
        launch.engine_args(),
        storage_dir,
        layout=Layout.at(app.settings.root, app.settings.state_dir),
        environ=server_environ(launch.command, os.environ),
        hands_env=hands_env,
    )
    command = engine.rewritten_command(launch.command, storage_dir, os.environ)
    if env_file is not None:
        write_atomic(env_file, envfile.contents(env_lines(launch, run)))
    machine = as_json or print_env
    for w in warnings:
        click.echo(f"cachemgr: warning: {w}", err=True)
    click.echo(describe(run.result), err=machine)
    if as_json:
        storage = str(run.result.storage_dir)
        out = {
            **dataclasses.asdict(run.result),
            "storage_dir": storage,
            "message": describe(run.result),
            "env": env_values(launch, run),
            **({"command": command} if command is not None else {}),
            # Said on stderr once per root; a machine reading this gets it every time.
            "warnings": [w for w in (version_warning(run.identity), *warnings) if w],
        }
        click.echo(json.dumps(out, indent=2))
    elif print_env:
        click.echo(env_lines(launch, run), nl=False)
    warn_refused(run.trash_refused)


def warn_refused(refused: tuple[str, ...]) -> None:
    """One stderr line about .trash/ entries deletion left alone; never a failure.

    The init itself succeeded, and a leftover in an old trash entry (a symlink, a foreign
    file) must not block every later server start (systemd ExecStartPre, initContainers).
    """
    if refused:
        click.echo(
            f"cachemgr: warning: {len(refused)} entries in .trash/ were left alone (first: "
            f"{refused[0]}): not cachemgr's page files; inspect and remove them by hand",
            err=True,
        )
