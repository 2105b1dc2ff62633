"""`cachemgr ls`: the namespaces under the root, what they hold and who uses them."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import click

from cachemgr.cli.context import AppContext, pass_app
from cachemgr.ns.purge import describe_trash
from cachemgr.ns.registry import list_namespaces
from cachemgr.ns.root import existing_layout, reading_store
from cachemgr.units import human_bytes


@click.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines (raw bytes).")
@pass_app
def ls(app: AppContext, as_json: bool) -> None:
    """List namespaces: id, instances, model, KV dtype, page size, pages, bytes, state."""
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
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"namespaces under {layout.root}", title_justify="left")
    for col in ("id", "instances", "model", "kv dtype", "page", "pages", "size"):
        right = col in ("page", "pages", "size")
        table.add_column(col, justify="right" if right else "left", no_wrap=col != "model")
    for col in ("created", "last active", "state"):
        table.add_column(col)
    for n in found:
        table.add_row(
            n.ns_id, ", ".join(n.instances) or "-", n.model or "?", n.kv_cache_dtype or "?",
            str(n.page_size or "?"), f"{n.pages:,}", human_bytes(n.bytes),
            _when(n.created_at), _when(n.last_active_at),
            n.state if n.problem is None else f"{n.state}: {n.problem}",
        )  # fmt: skip
    for t in trash:
        table.add_row(
            t.name, "-", "", "", "", f"{t.pages:,}", human_bytes(t.bytes), "", "",
            f"unsafe: {t.problem}" if t.problem else t.left_for_a_person or "deleting (in .trash)",
        )  # fmt: skip
    # Piped output keeps whole ids and names instead of rich's 80-column default.
    Console(width=None if sys.stdout.isatty() else 220).print(table)


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))
