"""What scripts/gen_sglang_flags.py and scripts/gen_vllm_flags.py share: reading an argparse
parser's actions into a flag table, and printing that table as Python source in the shape of
cachemgr/sglang/flags.py (word lists that ruff leaves alone)."""

import argparse
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class FlagTable:
    """A parser's flags as cachemgr's launch scanners need them."""

    no_value: set[str] = field(default_factory=set)  # store_true, BooleanOptionalAction, …
    multi: set[str] = field(default_factory=set)  # nargs "+" / "*"
    choices: dict[str, list[str]] = field(default_factory=dict)  # by dest
    integer: set[str] = field(default_factory=set)  # dests parsed with int()
    options: set[str] = field(default_factory=set)  # every option string, for argparse's prefixes


def read_table(actions: Iterable[argparse.Action], dests: set[str]) -> FlagTable:
    """Every action's arity; choices and int types only for `dests` (the settings read)."""
    table = FlagTable()
    for action in actions:
        table.options.update(action.option_strings)
        if action.nargs == 0:
            table.no_value.update(action.option_strings)
        elif action.nargs in ("+", "*"):
            table.multi.update(action.option_strings)
        if action.dest in dests and action.nargs != 0:
            # vLLM's --kv-cache-dtype lists its values only in the metavar (its type is str).
            values = action.choices or (action.metavar if isinstance(action.metavar, list) else [])
            if values:
                table.choices[action.dest] = [str(v) for v in values]
            if action.type is int:
                table.integer.add(action.dest)
    table.no_value -= {"-h", "--help"}
    return table


def words(names: Iterable[str]) -> str:
    """Sorted names, wrapped and indented for a triple-quoted word list."""
    text = textwrap.fill(
        " ".join(sorted(names)), 92, break_on_hyphens=False, break_long_words=False
    )
    return textwrap.indent(text, "    ")


def choice_lines(choices: dict[str, list[str]]) -> str:
    """`field: value value …` entries, one per field, wrapped."""
    return "\n".join(
        textwrap.fill(
            f"{dest}: {' '.join(values)}",
            96,
            initial_indent="    ",
            subsequent_indent="        ",
            break_on_hyphens=False,
            break_long_words=False,
        )
        for dest, values in sorted(choices.items())
    )


# What the generated module imports to read its CHOICES text back (cachemgr/flagtext.py).
IMPORTS = "from cachemgr.flagtext import by_field"
