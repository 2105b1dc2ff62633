"""`cachemgr ls`: the namespaces under the root, what they hold and who uses them."""

from __future__ import annotations

import dataclasses
import json
import time

import click

from cachemgr.cli.common import said_not_whole
from cachemgr.cli.context import AppContext, pass_app, setting_option
from cachemgr.cli.status import ASK_TIMEOUT, serving_root, unanswered
from cachemgr.cli.tables import Column, print_fitted
from cachemgr.fs.dirscan import Usage
from cachemgr.layout import Layout
from cachemgr.ns.purge import describe_trash
from cachemgr.ns.purge_intent import trash_counts
from cachemgr.ns.registry import NamespaceInfo, list_namespaces
from cachemgr.ns.root import existing_layout, reading_what_it_can
from cachemgr.ns.trash import TrashEntry
from cachemgr.settings import Settings
from cachemgr.units import human_bytes


@click.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines (raw bytes).")
@click.option("--wide", is_flag=True, help="Every column, however wide the table gets.")
@setting_option("--host", setting="host", help="Where the daemon listens (default: settings host).")
@setting_option(
    "--port", setting="port", type=int, help="The daemon's port (default: settings port)."
)
@pass_app
def ls(app: AppContext, as_json: bool, wide: bool) -> None:
    """List namespaces: id, instances, engine, model, KV dtype, page size, pages, bytes, state.

    Pages and bytes come from the index of the daemon serving the root when one answers on
    host:port (as `status`'s do), else from a scan of each namespace dir.
    """
    layout = existing_layout(app.settings)
    served = served_usage(app.settings, layout)
    with reading_what_it_can(layout, page_rows=False) as (store, missing):
        found = list_namespaces(layout, store, known=served)
        trash = describe_trash(layout, trash_counts(layout, store.conn))
    source = "disk" if served is None else "daemon"
    if as_json:
        out = {
            "root": str(layout.root),
            "source": source,
            "namespaces": [dataclasses.asdict(n) for n in found],
            "trash": [dataclasses.asdict(t) for t in trash],
            "state_dir_problem": missing,
        }
        click.echo(json.dumps(out, indent=2))
    elif not found and not trash:
        click.echo(f"no namespaces under {layout.root}")
    else:
        _table(layout, found, trash, wide, source)
    if said_not_whole(((n.ns_id, n.state, n.problem) for n in found), missing):
        raise SystemExit(1)


def served_usage(settings: Settings, layout: Layout) -> dict[str, Usage] | None:
    """Pages, bytes and temps of each namespace as the daemon serving this root has them in
    its index, when one answers with its index built; None to count them on disk. A
    namespace it could not read is left out (counted here, as this user sees it)."""
    report = serving_root(settings, layout.root, ASK_TIMEOUT)
    if report is None:
        unanswered(settings, layout)
        return None
    index = report.get("index")
    if not isinstance(index, dict) or index.get("ready") is not True:
        return None  # the first scan is not done: its counts are not whole
    return {
        ns["id"]: Usage(pages=ns["pages"], bytes=ns["bytes"], temps=ns.get("temp_files") or 0)
        for ns in report["namespaces"]
        if ns.get("has_dir") and ns.get("state") not in UNCOUNTED and ns["pages"] is not None
    }


# States of /v1/status whose pages the daemon did not count (cachemgr.ns.status).
UNCOUNTED = frozenset({"unreadable", "unsafe", "bad-manifest", "purged"})


def _table(
    layout: Layout, found: list[NamespaceInfo], trash: list[TrashEntry], wide: bool, source: str
) -> None:
    rows = [
        {
            "id": n.ns_id,
            "instances": ", ".join(n.instances) or "-",
            "engine": n.engine,
            "model": _model(n),
            "kv dtype": n.kv_cache_dtype or "?",
            "page": str(n.page_size or "?"),
            "pages": "?" if n.pages is None else f"{n.pages:,}",
            "size": "?" if n.bytes is None else human_bytes(n.bytes),
            "created": _when(n.created_at),
            "last active": _when(n.last_active_at),
            "state": n.state if n.problem is None else f"{n.state}: {n.problem}",
        }
        for n in found
    ] + [
        {
            "id": t.name,
            "instances": "-",
            "engine": "",
            "model": "",
            "kv dtype": "",
            "page": "",
            "pages": f"{t.pages:,}",
            "size": human_bytes(t.bytes),
            "created": "",
            "last active": "",
            "state": f"unsafe: {t.problem}"
            if t.problem
            else t.left_for_a_person or "deleting (in .trash)",
        }
        for t in trash
    ]
    title = f"namespaces under {layout.root}"
    if source == "daemon":  # counted on disk otherwise, as the title has always meant
        title += " (pages from the daemon's index)"
    print_fitted(title, COLUMNS, rows, DROP_ORDER, wide=wide)


# id, pages, size and state always stay; instances, model and state fold first.
COLUMNS = (
    Column("id"),
    Column("instances", flexible=True),
    Column("engine"),
    Column("model", flexible=True),
    Column("kv dtype"),
    Column("page", right=True),
    Column("pages", right=True),
    Column("size", right=True),
    Column("created"),
    Column("last active"),
    Column("state", flexible=True),
)
DROP_ORDER = ("created", "page", "kv dtype", "last active", "engine", "instances", "model")


def _model(n: NamespaceInfo) -> str:
    """Its model; marked when its manifest could not be read and the DB's copy says it."""
    if n.model is None:
        return "?"  # its state says why (a manifest that cannot be read, none at all)
    return f"{n.model} (registry)" if n.identity_from == "registry" else n.model


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))
