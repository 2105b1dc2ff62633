"""`cachemgr ls`: the namespaces under the root, what they hold and who uses them."""

from __future__ import annotations

import dataclasses
import json
import time

import click

from cachemgr.cli.context import AppContext, pass_app
from cachemgr.cli.tables import Column, print_fitted
from cachemgr.ns.purge import describe_trash
from cachemgr.ns.registry import list_namespaces
from cachemgr.ns.root import existing_layout, reading_store
from cachemgr.units import human_bytes


@click.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines (raw bytes).")
@click.option("--wide", is_flag=True, help="Every column, however wide the table gets.")
@pass_app
def ls(app: AppContext, as_json: bool, wide: bool) -> None:
    """List namespaces: id, instances, engine, model, KV dtype, page size, pages, bytes, state."""
    layout = existing_layout(app.settings)
    with reading_store(layout) as store:
        found = list_namespaces(layout, store)
    trash = describe_trash(layout)
    if as_json:
        out = {
            "root": str(layout.root),
            "namespaces": [dataclasses.asdict(n) for n in found],
            "trash": [dataclasses.asdict(t) for t in trash],
        }
        click.echo(json.dumps(out, indent=2))
        return
    if not found and not trash:
        click.echo(f"no namespaces under {layout.root}")
        return
    rows = [
        {"id": n.ns_id, "instances": ", ".join(n.instances) or "-", "engine": n.engine,
         "model": n.model or "?",
         "kv dtype": n.kv_cache_dtype or "?", "page": str(n.page_size or "?"),
         "pages": f"{n.pages:,}", "size": human_bytes(n.bytes), "created": _when(n.created_at),
         "last active": _when(n.last_active_at),
         "state": n.state if n.problem is None else f"{n.state}: {n.problem}"}
        for n in found
    ] + [
        {"id": t.name, "instances": "-", "engine": "", "model": "", "kv dtype": "", "page": "",
         "pages": f"{t.pages:,}", "size": human_bytes(t.bytes), "created": "", "last active": "",
         "state": f"unsafe: {t.problem}" if t.problem
                  else t.left_for_a_person or "deleting (in .trash)"}
        for t in trash
    ]  # fmt: skip
    print_fitted(f"namespaces under {layout.root}", COLUMNS, rows, DROP_ORDER, wide=wide)


# id, pages, size and state always stay; instances, model and state fold first.
COLUMNS = (
    Column("id"), Column("instances", flexible=True), Column("engine"),
    Column("model", flexible=True), Column("kv dtype"), Column("page", right=True),
    Column("pages", right=True),
    Column("size", right=True), Column("created"), Column("last active"),
    Column("state", flexible=True),
)  # fmt: skip
DROP_ORDER = ("created", "page", "kv dtype", "last active", "engine", "instances", "model")


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))
