"""Every default the README and the docs state is the default `Settings` has (the README once
showed a gc_min_age default of 2m; it is 0s)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cachemgr.settings import Settings
from cachemgr.units import parse_duration

REPO = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "docs/daemon.md", "docs/gc.md"]
# Defaults computed at run time, as the docs write them.
WRITTEN = {"root": "~/.cache/cachemgr", "state_dir": "<root>/.cachemgr"}
UNSET = {"none", "unset", "—", "(unset)"}


def _stated_defaults(text: str) -> list[tuple[str, str]]:
    """(setting, default as written) from each table with a `default` column, and from the
    `cachemgr config` sample's rows whose source is `default`."""
    found: list[tuple[str, str]] = []
    column = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if "|" in line else []
        if not cells:
            column = None
        elif "default" in cells and column is None:
            column = cells.index("default")
        elif column is not None and not set(cells[0]) <= set("- "):
            names = [n for n in re.findall(r"`([a-z_]+)`", cells[0]) if n in Settings.model_fields]
            values = [v.strip().strip("`") for v in cells[column].split(", ")]
            if len(names) == len(values):
                found += zip(names, values, strict=True)
            else:
                found += [(n, cells[column]) for n in names]  # one default shared by the row
    for row in re.findall(r"^([a-z_]+) {2,}(\S+) {2,}default$", text, re.MULTILINE):
        found.append(row)
    return found


def _is_default(name: str, written: str) -> bool:
    if name in WRITTEN:
        return written == WRITTEN[name]
    default = Settings.model_fields[name].default
    if default is None:
        return written in UNSET
    if isinstance(default, bool | str):
        return written == str(default)
    if isinstance(default, int | float):
        return float(written) == default
    return bool(parse_duration(written) == default)


@pytest.mark.parametrize("doc", DOCS)
def test_every_stated_default_is_the_settings_default(doc: str) -> None:
    stated = _stated_defaults((REPO / doc).read_text(encoding="utf-8"))
    assert stated, f"no defaults found in {doc}: the test no longer reads its tables"
    wrong = [(n, w) for n, w in stated if not _is_default(n, w)]
    assert wrong == [], f"{doc} states defaults Settings does not have: {wrong}"


def test_the_readme_config_sample_is_read() -> None:
    """The sample block's `default` rows are among what the test checks."""
    stated = dict(_stated_defaults((REPO / "README.md").read_text(encoding="utf-8")))
    assert {"port", "gc_min_age"} <= set(stated)
