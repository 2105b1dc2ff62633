"""The engine registry: every engine cachemgr manages, as one `Engine` object each.

The CLI, doctor and init ask it which engine a launch command starts, or which one wrote an
identity record, and then ask that object; the daemon asks it for the probe its settings name.
Adding an engine is a package with an `engine.py` and one line here (docs/architecture.md,
"Adding an engine").
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cachemgr.engine import Engine, Probe, ProbeHooks
from cachemgr.formats import DEFAULT_ENGINE, engine_of
from cachemgr.identity.record import Digested, parse_record, read_record_data
from cachemgr.settings import Settings
from cachemgr.sglang.engine import SGLANG
from cachemgr.vllm.engine import VLLM

ENGINES: tuple[Engine[Any], ...] = (SGLANG, VLLM)
DEFAULT: Engine[Any] = next(e for e in ENGINES if e.name == DEFAULT_ENGINE)


def named(name: str) -> Engine[Any]:
    """The engine of that name (an identity record's `engine` key)."""
    return next(e for e in ENGINES if e.name == name)


def for_record(identity: Digested) -> Engine[Any]:
    """The engine whose identity record this is."""
    return named(identity.ENGINE)


def for_launch(command: Sequence[str]) -> Engine[Any]:
    """The engine a launch command starts: the first that claims it, the default one last
    (it reads any command: an identity given by options alone is the default engine's)."""
    others = [e for e in ENGINES if e is not DEFAULT]
    return next(e for e in (*others, DEFAULT) if e.claims(command))


def probe(settings: Settings, hooks: ProbeHooks) -> Probe | None:
    """The probe of the running server `settings` name (the first engine that has one), if any."""
    return next((p for e in ENGINES if (p := e.probe(settings, hooks)) is not None), None)


def probe_metrics() -> dict[str, str]:
    """(name, help) of every metric an engine's probe may show."""
    return {name: text for e in ENGINES for name, text in e.probe_metrics.items()}


def record_file(path: Path) -> Digested:
    """The identity record in a record or manifest file, read as the engine its `engine` key
    names (none: the default engine)."""
    data = read_record_data(path)
    engine = named(engine_of(data if isinstance(data, dict) else None))
    return parse_record(path, data, engine.record)
