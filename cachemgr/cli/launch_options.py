"""The options every identity-aware command shares: launch settings, or the launch command.

Usage in a command module::

    @click.command()
    @launch_options
    @pass_app
    def init(app: AppContext, launch: LaunchRequest) -> None:
        args = launch.engine_args()                 # as the launch's engine reads them
        ident = launch.compute_identity(app.settings)

The command then accepts the default engine's identity flags (`--model-path X --kv-cache-dtype
fp8_e4m3 …`) and/or a launch command after `--` (`cachemgr init -- sglang serve --model-path X
…`); explicit options win. The registry (cachemgr.engines) says which engine a command starts;
an engine whose command says all (vLLM) refuses the flags.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sqlite3
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import click

from cachemgr import engines
from cachemgr.cli.context import AppContext, setting_option
from cachemgr.engine import Engine
from cachemgr.errors import CachemgrError
from cachemgr.fs.root import create_root
from cachemgr.identity.digest_cache import DigestCache
from cachemgr.identity.fingerprint import IdentityOptions
from cachemgr.identity.hashing import Progress
from cachemgr.identity.launchpython import installed_version, launch_python
from cachemgr.identity.record import Digested
from cachemgr.layout import Layout
from cachemgr.settings import Settings, warn_renamed
from cachemgr.state.snapshot import snapshot
from cachemgr.state.store import Store

F = TypeVar("F", bound=Callable[..., Any])
PROGRESS_MIN_BYTES = 256 << 20  # below this hashing takes well under a second
log = logging.getLogger(__name__)
# The identity flags of the engine an identity given without a launch command is for.
_FLAGS = engines.DEFAULT.identity_flags


@dataclass(frozen=True)
class LaunchRequest:
    """What the shared options said: explicit launch settings (the default engine's), the
    launch command, identity knobs (`versions`: an explicit version by engine name)."""

    overrides: dict[str, Any]
    command: tuple[str, ...]
    fast: bool = False
    versions: Mapping[str, str | None] = field(default_factory=dict)
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def engine(self) -> Engine[Any]:
        """The engine the launch command starts (the default one without a command)."""
        return engines.for_launch(self.command)

    def engine_args(self) -> Any:
        """The launch's settings as its engine reads them, explicit options on top."""
        if "args" not in self._cache:
            self._cache["args"] = self.engine.launch_args(self.command, self.overrides, os.environ)
        return self._cache["args"]

    def identity_options(self, settings: Settings) -> IdentityOptions:
        """Identity knobs: these options, and the settings (--salt and the granularity are
        settings flags, so they are in `settings` already)."""
        return IdentityOptions(
            salt=settings.identity_salt,
            fast=self.fast,
            engine_version=self.versions.get(self.engine.name),
            version_granularity=settings.engine_version_granularity,
            hash_workers=settings.hash_workers,
        )

    def compute_identity(self, settings: Settings, *, writes: bool = False) -> Digested:
        """The identity, with a progress bar on a terminal and the root's digest cache: `init`
        (`writes`) keeps what it hashed there; `fingerprint` reads a copy of it, if the root
        has a state DB, and writes nothing (the identity does not depend on a root)."""
        layout = Layout.at(settings.root, settings.state_dir)
        if writes:
            create_root(layout)
            with Store.open(layout.db_path) as store:
                return self._compute(settings, DigestCache(store))
        try:
            with snapshot(layout.db_path, page_rows=False) as copy:
                return self._compute(settings, DigestCache(copy))
        except (OSError, sqlite3.Error, CachemgrError) as e:  # unreadable, newer: no cache
            log.debug("digest cache not used", extra={"error": str(e)})
            return self._compute(settings, None)

    def _compute(self, settings: Settings, cache: DigestCache | None) -> Digested:
        return self.engine.compute_identity(
            self.engine_args(),
            self.identity_options(settings),
            cache=cache,
            progress=terminal_progress,
            installed=self._installed(cache),
        )

    def _installed(self, cache: DigestCache | None) -> Callable[[], str | None]:
        """The engine's version as the launch's own Python has it (the engine's venv), else
        as this one has it."""
        python = launch_python(self.command, os.environ)
        engine = self.engine

        def version() -> str | None:
            found = None
            if python is not None:
                found = installed_version(python, engine.distribution, cache)
            return found or engine.installed_version()

        return version


@contextlib.contextmanager
def terminal_progress(total: int) -> Iterator[Progress | None]:
    """A byte progress bar on stderr when it is a terminal and there is a lot to hash."""
    if total < PROGRESS_MIN_BYTES or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.progress import (
        Progress as Bar,
    )

    columns = (BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Bar("hashing model files", *columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("hash", total=total)
        yield lambda n: bar.advance(task, n)


def launch_options(f: F) -> F:
    """Add the SGLang options, the identity options and a trailing `-- LAUNCH_CMD…` to `f`.

    The command receives one `launch: LaunchRequest` keyword instead of the individual values.
    """
    names = [flag.field for flag in _FLAGS]

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        overrides = {name: kwargs.pop(name) for name in names}
        kwargs["launch"] = LaunchRequest(
            overrides=overrides,
            command=tuple(kwargs.pop("launch_cmd")),
            fast=kwargs.pop("fast"),
            versions={e.name: kwargs.pop(_version_param(e)) for e in engines.ENGINES},
        )
        return f(*args, **kwargs)

    decorators = [
        click.argument("launch_cmd", nargs=-1, type=click.UNPROCESSED, metavar="[-- LAUNCH_CMD…]"),
        setting_option(
            "--engine-version-granularity",
            setting="engine_version_granularity",
            type=click.Choice(["major.minor", "full", "none"]),
        ),
        deprecated_setting_option(
            "--sglang-version-granularity",
            setting="engine_version_granularity",
            type=click.Choice(["major.minor", "full", "none"]),
        ),
        *(
            click.option(
                e.version_option,
                _version_param(e),
                help=f"{e.label} version (default: the installed one).",
            )
            for e in engines.ENGINES
        ),
        click.option("--fast", is_flag=True, help="Hash safetensors headers + sizes only."),
        setting_option("--salt", setting="identity_salt"),
        *(
            click.option(f.option, f.field, type=f.value_type, default=None, help=f.help)
            for f in reversed(_FLAGS)
        ),
    ]
    decorated: Callable[..., Any] = wrapper
    for deco in decorators:
        decorated = deco(decorated)
    return decorated  # type: ignore[return-value]


def _version_param(engine: Engine[Any]) -> str:
    return f"{engine.name}_version"


def deprecated_setting_option(old: str, *, setting: str, **kwargs: Any) -> Callable[[F], F]:
    """A flag's old name, hidden: it still overrides `setting`, with a deprecation line."""

    def override(ctx: click.Context, _param: click.Parameter, value: Any) -> None:
        if value is not None:
            warn_renamed(f"flag {old}", "--" + setting.replace("_", "-"))
            ctx.ensure_object(AppContext).overrides[setting] = value

    return click.option(
        old, callback=override, expose_value=False, default=None, hidden=True, **kwargs
    )
