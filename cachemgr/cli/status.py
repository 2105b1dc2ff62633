"""`cachemgr status`: a ccache-style table per namespace, from the daemon if it runs."""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import click

from cachemgr.cli.common import said_not_whole
from cachemgr.cli.context import AppContext, pass_app, setting_option
from cachemgr.cli.tables import Column, echo_fitted, print_fitted
from cachemgr.doctor.fleet import lint_fleet
from cachemgr.doctor.root import disk_state, filesystem_line
from cachemgr.errors import NotFoundError, UnsafePathError
from cachemgr.fs.leadership import index_files
from cachemgr.fs.usage import DiskUsage
from cachemgr.gc.policy import GcPolicy
from cachemgr.layout import Layout
from cachemgr.ns.root import refuse_file_root, status_from_disk
from cachemgr.settings import Settings, load_settings
from cachemgr.units import human_age, human_bytes


def daemon_url(settings: Settings) -> str:
    """Where this host reaches the daemon the settings describe (a wildcard bind: loopback)."""
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    return f"http://{host}:{settings.port}"


def probe() -> None:
    """The image's HEALTHCHECK: /healthz of the daemon the settings describe, read as `serve`
    reads them (CACHEMGR_* and the CACHEMGR_CONFIG file; the probe once read CACHEMGR_PORT
    alone, so a port or host set in the file failed a healthy container); raises unless 200."""
    config = os.environ.get("CACHEMGR_CONFIG")
    settings = load_settings(Path(config) if config else None)
    with urllib.request.urlopen(f"{daemon_url(settings)}/healthz", timeout=4):
        pass


def daemon_json(settings: Settings, path: str, timeout: float = 1.0) -> dict[str, Any] | None:
    """The JSON object the daemon on host:port answers at `path`, or None if nothing does."""
    try:
        with urllib.request.urlopen(f"{daemon_url(settings)}{path}", timeout=timeout) as resp:
            data = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def from_daemon(settings: Settings, timeout: float = 1.0) -> dict[str, Any] | None:
    """The running daemon's /v1/status, or None if nothing answers on host:port."""
    data = daemon_json(settings, "/v1/status", timeout)
    return data if data is not None and "namespaces" in data else None


# How long status and ls wait for a daemon that accepted the connection: one busy with a scan
# of millions of pages may answer /v1/status late, and counting on disk instead takes longer
# (bench_scale's `status` at 2M pages took longer than `ls`, which then always counted on
# disk: it most likely gave up on the daemon after 1 s). Nothing listening is refused at once.
ASK_TIMEOUT = 5.0


def serving_root(settings: Settings, root: Path, timeout: float = 1.0) -> dict[str, Any] | None:
    """The /v1/status of the daemon on host:port when it serves `root`, else None."""
    served = from_daemon(settings, timeout)
    if served is None or not same_root(served.get("root"), root):
        return None
    return served


def unanswered(settings: Settings, layout: Layout) -> None:
    """Say on stderr why the count is on disk when a daemon indexes this root on this host but
    none answered for it on host:port: at millions of pages that count takes minutes (three
    at 10M pages, bench/RESULTS.md) while the daemon's index has it at once."""
    leadership, _ = index_files(layout)
    try:
        if not leadership.led_elsewhere():
            return
        holder = (leadership.holder() or "").split(" since ")[0] or "a process"
    except (OSError, UnsafePathError):  # an unreadable state dir: nothing to tell
        return
    click.echo(
        f"cachemgr: a daemon indexes {layout.root} ({holder}) but none answered for it on "
        f"{settings.host}:{settings.port}; counting from disk (give its --port or CACHEMGR_PORT)",
        err=True,
    )


def same_root(reported: object, root: Path) -> bool:
    """Whether the daemon serves this root: the same path (a daemon on another host, asked
    with --host, has no directory here) or the same directory spelled another way."""
    if not isinstance(reported, str):
        return False
    try:
        return reported == str(root) or os.path.samefile(reported, root)
    except OSError:
        return False


def _ago(ts: float | None) -> str:
    return f"{human_age(time.time() - ts)} ago" if ts else "never"


# Left to right. namespace, pages, size, reads and hit ratio always stay; the flexible ones
# shorten first, then the others go in DROP_ORDER while the table is wider than the output.
COLUMNS = (
    Column("namespace"),
    Column("engine"),
    Column("model", flexible=True),
    Column("kv dtype"),
    Column("page", right=True),
    Column("instances", flexible=True),
    Column("pages", right=True),
    Column("size", right=True),
    Column("reads", right=True),
    Column("writes", right=True),
    Column("hit ratio", right=True),
    Column("last write", right=True),
)
DROP_ORDER = ("kv dtype", "page", "last write", "engine", "instances", "model", "writes")


def _cells(ns: dict[str, Any]) -> dict[str, str]:
    ratio = ns.get("hit_ratio")
    # null: its dir could not be counted. Not the state: one whose manifest alone cannot be
    # read is unreadable too, and its pages were counted.
    counted = ns["pages"] is not None
    return {
        "namespace": ns["id"],
        "engine": ns.get("engine") or "sglang",
        "model": ns.get("model") or "?",
        "kv dtype": ns.get("kv_cache_dtype") or "?",
        "page": str(ns.get("page_size") or "?"),
        "instances": ", ".join(ns.get("instances") or []) or "-",
        "pages": f"{ns['pages']:,}" if counted else "?",
        "size": human_bytes(ns["bytes"]) if counted else "?",
        "reads": f"{ns['page_reads']:,}",
        "writes": f"{ns['page_writes']:,}",
        "hit ratio": "-" if ratio is None else f"{ratio:.1%}",
        "last write": _ago(ns.get("last_write_at")),
    }


def render(report: dict[str, Any], *, wide: bool = False) -> None:
    """The table people read at a glance, fitted to the output width (all of it with `wide`)."""
    source = f"(from {report.get('source', 'daemon')})"
    if not report["namespaces"]:
        click.echo(f"no namespaces under {report['root']} {source}")
        return
    title = f"cachemgr — {report['root']} {source}"
    rows = [_cells(ns) for ns in report["namespaces"]]
    print_fitted(title, COLUMNS, rows, DROP_ORDER, wide=wide)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
@click.option("--wide", is_flag=True, help="Every column, however wide the table gets.")
@setting_option("--host", setting="host", help="Where the daemon listens (default: settings host).")
@setting_option(
    "--port", setting="port", type=int, help="The daemon's port (default: settings port)."
)
@pass_app
def status(app: AppContext, as_json: bool, wide: bool) -> None:
    """Pages, bytes, reads, writes and hit ratio per namespace (from the daemon if it runs)."""
    settings = app.settings
    layout = Layout.at(settings.root, settings.state_dir)
    refuse_file_root(layout)
    report = from_daemon(settings, timeout=ASK_TIMEOUT)
    if report is not None and not same_root(report.get("root"), layout.root):
        click.echo(
            f"cachemgr: the daemon on {settings.host}:{settings.port} serves {report.get('root')},"
            f" not {layout.root}; counting from disk",
            err=True,
        )
        report = None
    if report is not None:
        report["source"] = "daemon"
        fleet = daemon_json(settings, "/v1/fleet", timeout=ASK_TIMEOUT)
        if fleet is not None and fleet.get("enabled"):
            report["fleet"] = fleet
    elif not layout.root.is_dir():
        raise NotFoundError(f"no cache root at {layout.root} (init or serve creates it)")
    else:
        unanswered(settings, layout)
        report = status_from_disk(layout)
    report["filesystem"] = _filesystem(layout, settings)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        render(report, wide=wide)
        echo_fitted(_filesystem_text(report["filesystem"]))
        for note in report.get("left_for_a_person") or ():  # an older daemon has none
            click.echo(f"warning: {note}")  # one line each: they name paths to grep for
        if "fleet" in report:
            _echo_fleet(report["fleet"])
    listed = ((ns["id"], ns.get("state", ""), ns.get("problem")) for ns in report["namespaces"])
    if said_not_whole(listed, report.get("state_dir_problem")):
        raise SystemExit(1)


def _echo_fleet(fleet: dict[str, Any]) -> None:
    """Who leads the fleet's GC, and what doctor would say of it (a node cut off from the
    coordinator, no leader at all: nothing deleted anywhere)."""
    node, leader = fleet.get("node"), fleet.get("leader")
    if fleet.get("leading"):
        heard = len(fleet.get("nodes") or [])
        click.echo(f"fleet: this node ({node}) leads GC, hearing from {heard} other nodes")
    elif leader:
        click.echo(f"fleet: node {node}; GC leader {leader} at {fleet.get('leader_url')}")
    for finding in lint_fleet(fleet):
        click.echo(f"warning: fleet: {finding.message}")


def _filesystem(layout: Layout, settings: Settings) -> dict[str, Any]:
    """The root's filesystem: bytes free and total, and whether it is full (doctor's rule)."""
    disk = DiskUsage(*shutil.disk_usage(layout.root))
    state, limit = disk_state(disk, GcPolicy.from_settings(settings))
    return {"free_bytes": disk.free, "size_bytes": disk.total, "state": state, "limit_bytes": limit}


def _filesystem_text(fs: dict[str, Any]) -> str:
    disk = DiskUsage(fs["size_bytes"], fs["size_bytes"] - fs["free_bytes"], fs["free_bytes"])
    line = f"filesystem: {filesystem_line(disk)}"
    if fs["state"] == "ok":
        return line
    word = "FULL" if fs["state"] == "full" else "nearly full"
    return f"{line}: {word} (GC keeps {human_bytes(fs['limit_bytes'])} free)"
