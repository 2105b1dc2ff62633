"""`cachemgr doctor`: lint a launch command and the root for HiCache file-cache pitfalls."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import click

from cachemgr import engines
from cachemgr.cli.context import AppContext, pass_app
from cachemgr.cli.launch_options import LaunchRequest
from cachemgr.cli.status import daemon_json, serving_root
from cachemgr.doctor.finding import Finding, exit_code
from cachemgr.doctor.fleet import lint_fleet
from cachemgr.doctor.permissions import SAMPLE, lint_deletable
from cachemgr.doctor.root import (
    lint_disk,
    lint_gc_unmet,
    lint_keys_in_memory,
    lint_state_disk,
    lint_watches,
)
from cachemgr.doctor.statedir import lint_root_and_state
from cachemgr.errors import CachemgrError
from cachemgr.gc.policy import GcPolicy
from cachemgr.identity.record import Digested
from cachemgr.layout import Layout
from cachemgr.ns.root import existing_layout
from cachemgr.settings import Settings


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@click.option(
    "--all-pages",
    is_flag=True,
    help=f"Check every page's flags and owner (default: the first {SAMPLE:,} of a namespace).",
)
@click.argument("launch_cmd", nargs=-1, type=click.UNPROCESSED, metavar="[-- LAUNCH_CMD…]")
@pass_app
def doctor(app: AppContext, as_json: bool, all_pages: bool, launch_cmd: tuple[str, ...]) -> None:
    """Check a launch (and the root) for HiCache pitfalls; exit 0 clean, 1 warnings, 2 errors.

    Checks: page size 1 with the file backend, mamba track interval vs page size on hybrid
    models, a storage dir cachemgr does not manage, one that holds another identity's pages or
    pages of no recorded identity, a cap larger than the free space, SGLang's own file evictor
    next to cachemgr's GC, no hierarchical cache or another backend. For a vLLM launch: no fs
    tier, no cap anywhere, a root_dir outside the root, shared by several models' servers, or
    holding another identity's blocks. For the root: pages GC's user cannot delete; the
    daemon's page keys held in its memory (its state dir not writable); in a fleet, a
    coordinator the daemon cannot reach, no GC leader, accesses the leader misses.
    """
    settings = app.settings
    layout = Layout.at(settings.root, settings.state_dir)
    if not launch_cmd:  # a launch is linted without a root; the root alone needs one
        existing_layout(settings)
    findings: list[Finding] = []
    served = serving_root(settings, settings.root)
    policy = served_policy(settings, served)
    if launch_cmd:
        findings += engines.for_launch(launch_cmd).lint(
            launch_cmd,
            layout=layout,
            policy=policy,
            identity=functools.cache(lambda: _identity(settings, launch_cmd)),
            environ=os.environ,
        )
    if layout.root.is_dir():
        findings += lint_gc_unmet(served.get("gc_unmet", []) if served else [])
        findings += lint_watches(served.get("index") if served else None)
        findings += lint_keys_in_memory(served, layout)
        findings += lint_fleet(daemon_json(settings, "/v1/fleet") if served else None)
        findings += lint_disk(layout, policy)
        findings += lint_state_disk(layout)
        findings += lint_root_and_state(layout, indexed=served is not None)
        findings += lint_deletable(layout, None if all_pages else SAMPLE)
    if as_json:
        click.echo(json.dumps([dataclasses.asdict(f) for f in findings], indent=2))
    else:
        for f in findings:
            click.echo(f"{f.severity:<7} {f.code}: {f.message}; fix: {f.fix}")
        if not findings:
            click.echo("no problems found" + ("" if launch_cmd else " (pass `-- <launch cmd>`)"))
    raise SystemExit(exit_code(findings))


def served_policy(settings: Settings, served: dict[str, Any] | None) -> GcPolicy:
    """The GC limits that hold on the root: those of the daemon serving it, when one answers
    (its env or file may set a cap this shell does not see), else this process's settings."""
    policy = GcPolicy.from_settings(settings)
    if served is None:
        return policy
    limits = served.get("gc_limits")
    if not isinstance(limits, dict):  # a daemon that runs no GC, or an older one
        return policy
    return dataclasses.replace(
        policy,
        max_bytes=limits.get("max_bytes"),
        namespace_max_bytes=limits.get("namespace_max_bytes"),
        min_free_bytes=limits.get("min_free_bytes", policy.min_free_bytes),
        min_free_percent=limits.get("min_free_percent", policy.min_free_percent),
        min_free_inodes_percent=limits.get(
            "min_free_inodes_percent", policy.min_free_inodes_percent
        ),
    )


def _identity(settings: Settings, launch_cmd: tuple[str, ...]) -> Digested | None:
    """The launch's identity as `fingerprint` computes it (the root's digest cache, read from
    a copy), or None when it cannot be computed here (the model is elsewhere)."""
    try:
        return LaunchRequest(overrides={}, command=launch_cmd).compute_identity(settings)
    except CachemgrError:
        return None
