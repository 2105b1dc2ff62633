"""`cachemgr gc`: bound the cache now (trash, temps, unbound namespaces, torn pages, LRU)."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from cachemgr import logs
from cachemgr.cli.common import ask
from cachemgr.cli.context import AppContext, pass_app, setting_option
from cachemgr.cli.status import daemon_json, daemon_url, serving_root
from cachemgr.errors import ConfigError, ConflictError, LimitNotHeld
from cachemgr.fleet.connect import current_leader
from cachemgr.fleet.coordinator import CoordinatorDown, LeaderRecord
from cachemgr.fs import reserve
from cachemgr.fs.deletion import Pacer
from cachemgr.fs.deletion import Progress as ProgressFn
from cachemgr.fs.leadership import gc_leadership
from cachemgr.fs.root import create_root
from cachemgr.gc.floor import floor_pass, open_or_take_young
from cachemgr.gc.policy import GcPolicy
from cachemgr.gc.runner import GcLocked, GcRunner
from cachemgr.gc.step import GcReport, joined
from cachemgr.ns.registry import adopt_from_disk
from cachemgr.ns.root import existing_layout, reading_store
from cachemgr.settings import Settings
from cachemgr.state.index import scan_root
from cachemgr.state.store import Store
from cachemgr.units import human_bytes

_LIMITS = [
    ("--max-bytes", "gc_max_bytes", str),
    ("--namespace-max-bytes", "gc_namespace_max_bytes", str),
    ("--min-free-bytes", "gc_min_free_bytes", str),
    ("--max-files", "gc_max_files", str),
    ("--namespace-max-files", "gc_namespace_max_files", str),
    ("--min-free-percent", "gc_min_free_percent", float),
    ("--min-free-inodes-percent", "gc_min_free_inodes_percent", float),
    ("--min-age", "gc_min_age", str),
    ("--tmp-ttl", "gc_tmp_ttl", str),
    ("--delete-rate", "gc_delete_rate", float),
]

_COUNTS = frozenset({"gc_max_files", "gc_namespace_max_files"})  # (files, not bytes)


def _limit_options(f: Any) -> Any:
    for flag, setting, kind in reversed(_LIMITS):
        f = setting_option(flag, setting=setting, type=kind)(f)
    return f


@click.command("gc")
@click.option("--dry-run", is_flag=True, help="Show what would be deleted; delete nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
@click.option("--yes", "-y", is_flag=True, help="Delete without asking.")
@_limit_options
@pass_app
def gc(app: AppContext, /, dry_run: bool, as_json: bool, yes: bool) -> None:
    """Delete what the GC policy says must go: leftovers in .trash/, stale .tmp files,
    unbound namespaces past retention, torn pages, then least recently used pages until
    under the caps and the free-space floor."""
    settings = app.settings
    if not (dry_run or yes or sys.stdin.isatty()):
        raise ConfigError("gc deletes files: pass --yes when not on a terminal (or --dry-run)")
    layout = existing_layout(settings)
    policy = GcPolicy.from_settings(settings)
    if dry_run:  # in a copy of the DB: the scan and the plan write nothing under the root
        with reading_store(layout) as store:
            _run(GcRunner(layout, store, policy), None, dry_run, yes, as_json)
        return
    _refuse_in_a_fleet(settings, app.overrides)
    create_root(layout)
    leadership = gc_leadership(layout)
    try:
        if not leadership.try_acquire():
            raise ConflictError(
                f"another process leads GC on {layout.root} ({leadership.holder()}); "
                f"nothing deleted: {_ask_the_leader(settings, app.overrides)}, or use --dry-run"
            )
        # Below the floor the DB may not open and new pages cannot be indexed: free space
        # from a scan of the disk first (cachemgr.gc.floor), then run GC as usual.
        floor = floor_pass(
            layout,
            policy,
            disk_usage=reserve.usage_with_reserve(layout.state_dir),
            pacer=Pacer(policy.delete_rate),
            gate=lambda: yes or _confirm_floor(),
        )
        young = None  # what the floor pass kept for min_age, taken if the DB cannot open
        if floor is None:
            store = Store.open(layout.db_path)
        else:
            store, young = open_or_take_young(layout, policy, floor)
        with store:  # a corrupt DB: moved aside, the CLI retries
            runner = GcRunner(layout, store, policy, leadership=leadership)
            try:
                for done in (floor, young):
                    if done is not None:
                        runner.record_floor(done, "cli")
                if floor is not None and young is not None:  # the second pass's word stands
                    floor = joined(floor, young)
                _run(runner, floor, dry_run, yes, as_json)
            finally:
                runner.held.abandon()  # its rows end with this process: said
    finally:
        leadership.release()


def _confirm_floor() -> bool:
    ask("free space is below the floor: delete the oldest pages first?", declined="nothing deleted")
    return True


def _refuse_in_a_fleet(settings: Settings, overrides: dict[str, Any]) -> None:
    """ConflictError on a fleet's shared root: only the node holding the GC lease deletes
    there. A follower's daemon lets its node's gc.lock go, so a run on that node took the lock
    and deleted beside the leader, by this node's accesses alone (evicting pages that other
    nodes read)."""
    why = _fleet_leader_note(settings, overrides)
    if why is not None:
        raise ConflictError(
            f"{settings.root} is a fleet's shared root, where only the GC lease holder "
            f"deletes; nothing deleted: {why}; or use --dry-run"
        )


def _fleet_leader_note(settings: Settings, overrides: dict[str, Any]) -> str | None:
    """Who leads the fleet and how to ask it; None off a fleet. A fleet is known by this
    shell's fleet_coordinator, or by the daemon serving the root here (a shell without the
    daemon's environment)."""
    leader: LeaderRecord | None = None
    if settings.fleet_coordinator is not None:
        try:
            leader = current_leader(settings)
        except CoordinatorDown as e:
            return f"its coordinator did not answer ({e}), and no node deletes without the lease"
    else:
        served = serving_root(settings, settings.root) is not None
        seen = daemon_json(settings, "/v1/fleet") if served else None
        if seen is None or not seen.get("enabled"):
            return None
        node, url = seen.get("leader"), seen.get("leader_url")
        leader = LeaderRecord(str(node), str(url)) if node and url else None
    if leader is None:
        return "no node holds its GC lease now (GET /v1/fleet on a node says why)"
    return f"node {leader.node} holds the lease: {_ask_the_leader(settings, overrides, leader.url)}"


def _ask_the_leader(settings: Settings, overrides: dict[str, Any], url: str | None = None) -> str:
    """How to run this GC through the daemon that leads (`url`, else this host's): the exact
    curl, with the limits the flags gave as POST /v1/gc's one-off limits (checked there as
    here)."""
    given = [s for _, s, _ in _LIMITS if overrides.get(s) is not None]
    # A count as a number, as the settings read the flag's text: the API refuses it as text.
    limits = {s: getattr(settings, s) if s in _COUNTS else overrides[s] for s in given}
    body = json.dumps({s.removeprefix("gc_"): v for s, v in limits.items()})
    if url is None and serving_root(settings, settings.root) is None:
        return f"ask its daemon with POST /v1/gc and the body {body}"
    # Double quotes: the shell expands the token's variable, and the token stays off screen.
    # Its whitespace goes, as the daemon strips it from the token it reads (a bearer token
    # has none inside, RFC 6750): curl sends a trailing newline as it is, the server reads
    # the line end after it as the end of the headers, and GC ran without the limits.
    token = """$(printf %s "$CACHEMGR_TOKEN" | tr -d '[:space:]')"""
    auth = f' -H "Authorization: Bearer {token}"' if settings.token else ""
    rest = ["-H", "Content-Type: application/json", "-d", body]
    url = f"{url or daemon_url(settings)}/v1/gc"
    return f"ask the daemon: curl -X POST{auth} {shlex.join([*rest, url])}"


def _run(runner: GcRunner, floor: GcReport | None, dry_run: bool, yes: bool, as_json: bool) -> None:
    # A lost DB forgot them; the disk did not (a dry run works on a copy: no file is written).
    adopt_from_disk(runner.layout, runner.store, write_files=not dry_run)
    scan_root(runner.layout, runner.store)  # no daemon may be watching: bring the index in line
    if dry_run or not yes:
        preview = runner.run(dry_run=True, actor="cli")  # a --dry-run plans the floor pass too
        if dry_run or preview.files == 0:
            _show(joined(floor, preview), as_json)
            if not dry_run:  # nothing GC may delete is no success when a limit needs files gone
                _check_held(joined(floor, preview))
            return
        _show(preview, as_json=False)
        ask("Delete these files?", declined="nothing deleted")
    stopped: GcLocked | None = None
    with _progress(as_json=as_json) as report_progress:
        try:
            report = runner.run(actor="cli", progress=report_progress, floor=floor)
        except GcLocked as e:  # what went before the lock is shown, then the error
            report, stopped = e.report, e
    _show(report, as_json)
    if stopped is not None:
        raise stopped
    _check_held(report)


def _check_held(report: GcReport) -> None:
    """Exit 1 (LimitNotHeld) when a step holding a limit had files refused, or the plan had
    too little it may delete to hold one."""
    if report.held:
        return
    refused = sum(report.refused_files().values())
    why = [f"{refused:,} files GC had to delete could not be"] if refused else []
    why += [f"{u.reason} still over its high watermark" for u in report.unmet]
    raise LimitNotHeld(
        f"the limit was not held: {'; '.join(why)} "
        "(see the warnings above; `cachemgr doctor` says how to fix it)"
    )


@contextmanager
def _progress(*, as_json: bool) -> Iterator[ProgressFn | None]:
    """A rich live line on a terminal (none under --json: the JSON is for a program, which
    may read stderr too); a log line a second otherwise."""
    if sys.stderr.isatty() and as_json:
        yield None
        return
    if not sys.stderr.isatty():
        due = logs.every(1.0)

        def tick(files: int, size: int) -> None:
            if due():
                logs.PROGRESS.info("deleting", extra={"files": files, "bytes": size})

        yield tick
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("deleting")
        yield lambda files, size: bar.update(
            task, description=f"deleted {files:,} files, {human_bytes(size)}"
        )


def _show(report: GcReport, as_json: bool) -> None:
    if as_json:
        # Imported here: the HTTP models pull in fastapi (~0.3 s), which only serve needs.
        from cachemgr.daemon.gcapi import GcResponse

        click.echo(json.dumps(GcResponse.of(report).model_dump(mode="json"), indent=2))
        return
    if report.files:
        verb = "would delete" if report.dry_run else "deleted"
        click.echo(f"{verb} {report.files:,} files, {human_bytes(report.bytes)}")
    else:
        click.echo("nothing to delete")
    totals = report.totals()
    if totals:
        click.echo(f"  {'reason':<11} {'files':>10} {'bytes':>10}")
    for reason, (files, size) in totals.items():
        click.echo(f"  {reason:<11} {files:>10,} {human_bytes(size):>10}")
    kept = [(s.rel_dir, s.young, len(s.refused)) for s in report.steps if s.young or s.refused]
    for rel_dir, young, refused in kept:
        click.echo(f"  kept in {rel_dir}: {young} too young, {refused} refused")
    for warning in report.warnings:
        click.echo(f"warning: {warning}", err=True)
