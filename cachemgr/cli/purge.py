"""`cachemgr purge`: drop namespaces now (rename away, recreate empty if bound, delete)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
import time

import click

from cachemgr.cli.common import ask, drain_with_progress
from cachemgr.cli.context import AppContext, pass_app
from cachemgr.errors import CachemgrError, ConfigError, StateLocked
from cachemgr.fs.deletion import DeleteReport, Pacer
from cachemgr.fs.root import create_root
from cachemgr.ns.purge import (
    PurgePlan,
    PurgeResult,
    PurgeTarget,
    TrashEntry,
    describe_trash,
    execute_purge,
)
from cachemgr.ns.purge import plan_purge as make_plan
from cachemgr.ns.purge_intent import trash_counts
from cachemgr.ns.purge_plan import in_use_note
from cachemgr.ns.root import existing_layout, opened_store, reading_store
from cachemgr.units import human_bytes


def _finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """NaN passes a FloatRange (it compares false with both bounds) and paced nothing."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a number of files per second", ctx, param)
    return value


@click.command("purge")
@click.option("--namespace", metavar="ID", help="Purge this namespace (16 hex digits).")
@click.option("--instance", metavar="NAME", help="Purge the namespace this instance is bound to.")
@click.option("--all", "all_", is_flag=True, help="Purge every namespace.")
@click.option("--unbound", is_flag=True, help="Purge every namespace no instance is bound to.")
@click.option("--dry-run", is_flag=True, help="Print what would be purged; change nothing.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask; required when stdin is no terminal.")
@click.option(
    "--wait/--no-wait",
    default=True,
    help="Delete the files now (default), or leave them in .trash/ for the daemon or next run.",
)
@click.option(
    "--rate",
    type=click.FloatRange(min=1, max=1e9),  # gc_delete_rate's bounds
    callback=_finite,
    metavar="FILES_PER_S",
    help="Cap the deletion rate to spare a running server's writes (default: full speed).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
@pass_app
def purge(
    app: AppContext,
    namespace: str | None,
    instance: str | None,
    all_: bool,
    unbound: bool,
    dry_run: bool,
    yes: bool,
    wait: bool,
    rate: float | None,
    as_json: bool,
) -> None:
    """Purge namespaces: renamed away at once, recreated empty if bound, files then deleted.

    Trash left by an earlier run (a crash, --no-wait) is deleted too.
    """
    layout = existing_layout(app.settings)
    select = functools.partial(
        make_plan, namespace=namespace, instance=instance, all=all_, unbound=unbound
    )
    if dry_run:
        with reading_store(layout) as store:
            plan = select(layout, store)
            trash = describe_trash(layout, trash_counts(layout, store.conn))
        _show_plan(plan, layout_trash=trash, as_json=as_json)
        return
    create_root(layout)  # a root whose ns/ or .trash/ went missing still purges
    with opened_store(layout) as store:
        plan = select(layout, store)
        if plan.targets and not yes:
            _confirm(plan)
        result = execute_purge(plan, layout, store, actor="cli", reason="manual")
        started = time.monotonic()
        report = (
            drain_with_progress(layout, store, actor="cli", pacer=Pacer(rate=rate))
            if wait
            else None
        )
        elapsed = time.monotonic() - started
    left = [*plan.problems, *(report.refused if report is not None else ())]
    if as_json:
        out = {
            "dry_run": False,
            "plan": dataclasses.asdict(plan),
            "result": dataclasses.asdict(result),
            "deleted": dataclasses.asdict(report) if report else None,
            "problems": left,
        }
        click.echo(json.dumps(out, indent=2))
    else:
        _show_result(plan, result, report, elapsed)
    _fail_if_left_alone(left)
    if report is not None and report.stopped:
        raise StateLocked(
            "the drain of .trash/ stopped: the state DB was write-locked by another process "
            "(the warning above names it); what it deleted is recorded, the rest stays in "
            ".trash/ for the daemon or the next purge"
        )


def _fail_if_left_alone(left: list[str]) -> None:
    """Exit non-zero, once everything else is done, if a namespace or trash entry was skipped."""
    for problem in left:
        click.echo(f"cachemgr: warning: left alone: {problem}", err=True)
    if left:
        raise CachemgrError(
            f"{len(left)} namespace(s) or trash entries were left alone (first: {left[0]}); "
            "inspect them by hand (cachemgr doctor lists them)"
        )


def _confirm(plan: PurgePlan) -> None:
    """Ask on a terminal; refuse, rather than hang, when nobody can answer."""
    if not sys.stdin.isatty():
        raise ConfigError("purge deletes files: pass --yes to confirm (stdin is not a terminal)")
    for t in plan.targets:
        click.echo(_target_line(t), err=True)
    ask(
        f"purge {len(plan.targets)} namespace(s), {plan.pages:,} pages, {human_bytes(plan.bytes)}?",
        declined="nothing purged",
    )


def _target_line(t: PurgeTarget) -> str:
    what = f"ns {t.ns_id} ({t.pages:,} pages, {human_bytes(t.bytes)})"
    if t.instances:
        return f"{what}: bound to {', '.join(t.instances)}, recreated empty"
    if t.users:
        return f"{what}: unbound, {in_use_note(t.users)}, recreated empty"
    return f"{what}: unbound, removed with its manifest"


def _show_plan(plan: PurgePlan, *, layout_trash: list[TrashEntry], as_json: bool) -> None:
    # What the real run would leave and fail over: its damaged namespaces, and trash entries
    # its drain refuses (a link in an entry's place) or cannot finish (foreign files).
    left = [*plan.problems, *(p for e in layout_trash if (p := _left_of(e)))]
    if as_json:
        out = {
            "dry_run": True,
            "plan": dataclasses.asdict(plan),
            "trash": [dataclasses.asdict(t) for t in layout_trash],
            "problems": left,
        }
        click.echo(json.dumps(out, indent=2))
        return
    for t in plan.targets:
        click.echo("would purge " + _target_line(t))
    for e in layout_trash:
        if e.problem is None:
            verb = "finish deleting" if e.left_for_a_person is None else "delete the pages of"
            size = f"{e.pages:,} pages, {human_bytes(e.bytes)}"
            click.echo(f"would {verb} .trash/{e.name} ({size})")
    for problem in left:
        click.echo(f"would leave alone {problem}")
    if not plan.targets and not layout_trash:
        click.echo(f"nothing to purge ({plan.selector})")
    click.echo("dry run: nothing changed")


def _left_of(entry: TrashEntry) -> str | None:
    """Why a drain would leave `entry` (or part of it), or None."""
    why = entry.problem or entry.left_for_a_person
    return f".trash/{entry.name}: {why}" if why else None


def _show_result(
    plan: PurgePlan, result: PurgeResult, report: DeleteReport | None, elapsed: float
) -> None:
    for p in result.purged:
        tail = "recreated empty" if p.recreated else "manifest removed"
        click.echo(f"purged ns {p.ns_id} ({p.pages:,} pages, {human_bytes(p.bytes)}): {tail}")
    if report is None:
        click.echo("files left in .trash/ for the daemon or the next purge (--no-wait)")
    elif report.files:
        click.echo(
            f"deleted {report.files:,} files ({human_bytes(report.bytes)}) in {elapsed:.1f} s"
        )
    elif plan.targets and not result.purged:
        # A bound namespace whose dir is already empty has nothing to rename away.
        click.echo("nothing to purge: already empty, or another purge got there first")
    elif not result.purged:
        click.echo(f"nothing to purge ({plan.selector})")
