"""One command-line token read as argparse reads it against a parser's option strings.

SGLang's parser and vLLM's `FlexibleArgumentParser` keep argparse's `allow_abbrev`: any unique
prefix of a long flag is that flag (`--kv-cache-dtyp fp8_e4m3` sets the KV dtype), and a flag
the parser does not know is refused. This is Python 3.11's `ArgumentParser._parse_optional`
and `_get_option_tuples` (the engines' envs run 3.11), over a generated table of the engine's
option strings (`OPTIONS` in cachemgr/sglang/flags.py, cachemgr/vllm/flags.py). `--` itself
ends the options; the scanners handle it before asking here.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass

from cachemgr.errors import ConfigError

# argparse's _negative_number_matcher: with no option that looks like one, `-1` is a value.
_NEGATIVE = re.compile(r"^-\d+$|^-\d*\.\d+$")


@dataclass(frozen=True)
class Option:
    """A token that names one of the parser's options."""

    name: str  # the option string it resolves to (`--kv-cache-dtype`)
    explicit: str | None = None  # the value in the token itself (`=fp8`, or `-qawq`'s `awq`)


def read_option(token: str, options: Collection[str], engine: str) -> Option | None:
    """The option `token` names, None if argparse reads it as a value; a ConfigError naming
    the token if it is an ambiguous prefix or a flag `engine` (e.g. "SGLang 0.5.23") lacks."""
    if not token or token[0] != "-":
        return None
    if token in options:
        return Option(token)
    if len(token) == 1:
        return None
    name, eq, value = token.partition("=")
    if eq and name in options:
        return Option(name, value)
    matches = _prefix_matches(token, options)
    if len(matches) > 1:
        spelled = ", ".join(sorted(m.name for m in matches))
        raise ConfigError(f"ambiguous flag {token}: {engine} could read it as {spelled}")
    if matches:
        return matches[0]
    if _NEGATIVE.match(token) or " " in token:
        return None
    raise ConfigError(f"unknown flag {name}: {engine} has no such flag and refuses it")


def _prefix_matches(token: str, options: Collection[str]) -> list[Option]:
    """argparse's _get_option_tuples: a `--long` prefix up to its `=`; a single-dash token is
    a prefix too, or a one-letter option with its value attached (`-qawq`)."""
    if token[1] == "-":
        prefix, eq, value = token.partition("=")
        explicit = value if eq else None
        return [Option(o, explicit) for o in options if o.startswith(prefix)]
    short = token[:2]
    return [
        Option(o, token[2:]) if o == short else Option(o)
        for o in options
        if o == short or o.startswith(token)
    ]
