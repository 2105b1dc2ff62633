"""Tables that fit the output: the columns that matter always, the others shortened or dropped.

`status` and `ls` go to terminals, pipes and logs alike. Piped output is 80 columns unless
COLUMNS says otherwise, so a table is fitted to that width: flexible columns (names, lists,
free text) fold or shorten first, then optional columns go in a set order, and a last line
names what was left out. Ids and numbers are never cut; `--wide` prints every column.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import click
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

# How narrow a flexible column may get before an optional column is dropped instead.
FLEX_MIN = 12


@dataclass(frozen=True)
class Column:
    """One column: right-aligned (numbers), flexible (may fold or shorten), or neither."""

    name: str
    right: bool = False
    flexible: bool = False


def output_width() -> int:
    """COLUMNS if set, else the terminal's width, else 80 (piped output, logs)."""
    return shutil.get_terminal_size((80, 24)).columns


def _table(columns: Sequence[Column], rows: Sequence[Mapping[str, str]], cap: bool) -> Table:
    table = Table()
    for col in columns:
        table.add_column(
            col.name,
            justify="right" if col.right else "left",
            # no_wrap: rich would otherwise squeeze a 16-char id to "e52…"
            no_wrap=not col.flexible,
            overflow="fold" if col.flexible else "ellipsis",
            max_width=FLEX_MIN if cap and col.flexible else None,
        )
    for row in rows:
        table.add_row(*(row[c.name] for c in columns))
    return table


def _widest(console: Console, table: Table) -> int:
    """The width the table wants, not what the console has left."""
    return Measurement.get(console, console.options.update_width(10_000), table).maximum


def print_fitted(
    title: str,
    columns: Sequence[Column],
    rows: Sequence[Mapping[str, str]],
    drop_order: Sequence[str],
    *,
    wide: bool = False,
) -> None:
    """Print the table in the output width, or whole with `wide`; say which columns went.

    The title is a line of its own: rich would wrap a long root path in the middle of a name.
    """
    width = output_width()
    console = Console(width=10_000)
    kept = list(columns)
    if not wide:
        for name in (None, *drop_order):
            kept = [c for c in kept if c.name != name]
            if _widest(console, _table(kept, rows, cap=True)) <= width:
                break
    table = _table(kept, rows, cap=False)
    # Wider than the output only with --wide or when even the kept columns do not fit: rich
    # would otherwise cut ids to make them fit.
    needed = _widest(console, _table(kept, rows, cap=not wide))
    click.echo(title)
    Console(width=max(width, needed)).print(table)
    hidden = [c.name for c in columns if c not in kept]
    if hidden:
        # A no-break space keeps "kv dtype" on one line (textwrap splits at ASCII spaces only).
        names = ", ".join(name.replace(" ", "\N{NO-BREAK SPACE}") for name in hidden)
        echo_fitted(f"not shown at {width} columns (--wide shows all): {names}")


def echo_fitted(text: str) -> None:
    """A line of prose, folded at the output width at ASCII spaces (no-break spaces hold)."""
    filled = textwrap.fill(text, output_width(), break_long_words=False, break_on_hyphens=False)
    click.echo(filled.replace("\N{NO-BREAK SPACE}", " "))
