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

from cachemgr.cli.common import drain_with_progress
from cachemgr.cli.context import AppContext, pass_app, setting_option
from cachemgr.cli.launch_options import LaunchRequest, launch_options
from cachemgr.errors import ConfigError
from cachemgr.fs.atomic import write_atomic
from cachemgr.identity.engines import AnyIdentity
from cachemgr.ns import init as ns_init
from cachemgr.ns.init import InitRun, engine_missing
from cachemgr.ns.prelaunch import STORAGE_DIR_ENV, InitResult, StorageDirConflict
from cachemgr.ns.root import created_layout
from cachemgr.units import human_bytes
from cachemgr.vllm.args import VllmLaunchArgs
from cachemgr.vllm.rewrite import KV_CONFIG_ENV, ROOT_DIR_ENV, point_root_dir, pointed_config

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
            help="When the identity changed: purge the old namespace (default, unless another "
            "instance uses it) or retain it.",
        ),
        setting_option(
            "--instance",
            setting="instance",
            metavar="NAME",
            help="Server instance name (default: default).",
        ),
        click.option(
            "--force",
            is_flag=True,
            help="Purge the old namespace even if a running process on this host still uses "
            "it as its storage dir (another server under the same instance name).",
        ),
    ]
    for deco in decorators:
        f = deco(f)
    return f


def run_init(app: AppContext, launch: LaunchRequest, *, wait: bool, force: bool) -> InitRun:
    """Check the launch, create the root, compute the identity, init its namespace
    (cachemgr.ns.init). A launch refused here leaves the root as it was (or absent)."""
    settings = app.settings
    args = launch.engine_args() if launch.command else None
    if isinstance(args, VllmLaunchArgs):
        check_vllm_launch(launch, args)
    layout = created_layout(settings)
    run = ns_init.run_init(
        layout,
        launch.compute_identity(settings, writes=True),
        args,
        instance=settings.instance,
        on_change=settings.on_change,
        environ=os.environ,
        force=force,
        drain=functools.partial(drain_with_progress, actor="cli") if wait else None,
    )
    warning = version_warning(run.identity)
    if warning is not None and not run.engine_missing_told:
        click.echo(f"cachemgr: warning: {warning}", err=True)
    return run


def check_vllm_launch(launch: LaunchRequest, args: VllmLaunchArgs) -> None:
    """A vLLM launch must have an fs tier cachemgr can point at its namespace dir."""
    if args.tier is None:
        raise ConfigError(
            "the vLLM launch has no fs tier: add --kv-transfer-config with "
            'kv_connector_extra_config.secondary_tiers [{"type": "fs", "root_dir": …}] '
            "(docs/vllm.md); cachemgr would have nothing to manage"
        )
    point_root_dir(launch.command, "/cachemgr-check", dict(os.environ))  # refuses before init


def vllm_command(launch: LaunchRequest, result: InitResult) -> list[str]:
    """The vLLM launch with its fs tier's root_dir set to the namespace dir."""
    return point_root_dir(launch.command, str(result.storage_dir), dict(os.environ))


def version_warning(identity: AnyIdentity) -> str | None:
    """What to say when no installed engine gave the identity its version, with the fix."""
    if not engine_missing(identity):
        return None
    name, option = identity.ENGINE_NAME, f"--{identity.ENGINE}-version"
    if identity.engine_version_from == "namespace":
        return (
            f"{name} is not installed here; using version {identity.engine_version} of the "
            f"instance's namespace (pass {option} to be explicit)"
        )
    example = "0.33.0" if identity.ENGINE == "vllm" else "0.5.23"
    return (
        f"{name} is not installed here, so the identity's {name} version is 'unknown'; pass "
        f"{option} (e.g. {example}) so init and exec agree"
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
    """The variables init hands the namespace dir in: SGLang reads its own; a vLLM launch
    needs it in its fs tier's root_dir, so it gets its --kv-transfer-config too (docs/vllm.md)."""
    storage = str(run.result.storage_dir)
    if not isinstance(run.args, VllmLaunchArgs):
        return {STORAGE_DIR_ENV: storage}
    config = pointed_config(launch.command, storage, dict(os.environ))
    return {ROOT_DIR_ENV: storage, KV_CONFIG_ENV: config}


def env_lines(launch: LaunchRequest, run: InitRun) -> str:
    return "".join(f"{k}={shlex.quote(v)}\n" for k, v in env_values(launch, run).items())


@click.command("init")
@init_options
@click.option(
    "--print-env",
    is_flag=True,
    help=f"Print {STORAGE_DIR_ENV}=… (for vLLM {ROOT_DIR_ENV}=… and {KV_CONFIG_ENV}=…) on stdout.",
)
@click.option(
    "--env-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write what --print-env prints to this file (atomically), e.g. for an initContainer.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@pass_app
def init(
    app: AppContext,
    launch: LaunchRequest,
    wait: bool,
    force: bool,
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
    if env_file is not None and not env_file.parent.is_dir():  # before anything is made
        raise ConfigError(f"--env-file {env_file}: {env_file.parent} is not a directory")
    run = run_init(app, launch, wait=wait, force=force)
    hands_env = print_env or env_file is not None
    warnings = [_conflict_warning(c, hands_env) for c in run.conflicts]
    warnings = [w for w in warnings if w]
    command = vllm_command(launch, run.result) if isinstance(run.args, VllmLaunchArgs) else None
    if isinstance(run.args, VllmLaunchArgs) and not hands_env:
        warnings += _root_dir_warning(run.args, run.result)
    if env_file is not None:
        write_atomic(env_file, env_lines(launch, run).encode())
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


def _root_dir_warning(args: VllmLaunchArgs, result: InitResult) -> list[str]:
    root = args.tier.root_dir if args.tier else None
    if root is None or os.path.abspath(root).rstrip("/") == str(result.storage_dir):
        return []
    return [
        f"the launch's fs tier root_dir is {root}, not the namespace dir: start the server "
        'with `cachemgr exec -- <launch>`, or with --json\'s "command"'
    ]


def _conflict_warning(c: StorageDirConflict, hands_env: bool) -> str | None:
    """What to tell about another storage dir setting; None when ours replaces it anyway."""
    if c.beats_env:
        if c.ours and hands_env:
            return None  # our own env file from an earlier run: the new one replaces it
        return (
            f"{c.source} is set to {c.path}; SGLang reads it before anything else, so a server "
            "started with this environment bypasses cachemgr: unset it"
        )
    if hands_env:
        return (
            f"{c.source} is {c.path}; {STORAGE_DIR_ENV} from cachemgr overrides it in SGLang, "
            "remove it from the launch command"
        )
    return (
        f"{c.source} is {c.path}: SGLang uses it unless the server gets {STORAGE_DIR_ENV} "
        "(use --env-file, --print-env or `cachemgr exec`)"
    )


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
