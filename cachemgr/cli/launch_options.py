"""The options every identity-aware command shares: SGLang settings, or the launch command.

Usage in a command module::

    @click.command()
    @launch_options
    @pass_app
    def init(app: AppContext, launch: LaunchRequest) -> None:
        args = launch.launch_args()                 # LaunchArgs (host, port, model, …)
        ident = launch.compute_identity(app.settings)

The command then accepts `--model-path X --kv-cache-dtype fp8_e4m3 …` and/or a launch command
after `--` (`cachemgr init -- sglang serve --model-path X …`); explicit options win. A vLLM
launch (`-- vllm serve M …`, cachemgr.vllm.args) takes no SGLang options: its command says all.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sqlite3
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import click

from cachemgr.cli.context import setting_option
from cachemgr.errors import CachemgrError, ConfigError
from cachemgr.fs.root import create_root
from cachemgr.identity.digest_cache import DigestCache
from cachemgr.identity.engines import AnyIdentity
from cachemgr.identity.fingerprint import (
    IdentityOptions,
    compute_identity,
    installed_sglang_version,
)
from cachemgr.identity.hashing import Progress
from cachemgr.identity.launchpython import installed_version, launch_python
from cachemgr.identity.vllm import compute_vllm_identity, installed_vllm_version
from cachemgr.layout import Layout
from cachemgr.settings import Settings
from cachemgr.sglang.args import LaunchArgs, resolve_launch_args
from cachemgr.state.snapshot import snapshot
from cachemgr.state.store import Store
from cachemgr.vllm.args import VllmLaunchArgs, is_vllm_launch, resolve_vllm_args

F = TypeVar("F", bound=Callable[..., Any])
PROGRESS_MIN_BYTES = 256 << 20  # below this hashing takes well under a second
log = logging.getLogger(__name__)

# (option, LaunchArgs field, type, help) — named as SGLang names them where it is short.
_SGLANG_OPTIONS: list[tuple[str, str, Any, str]] = [
    ("--model-path", "model_path", str, "Model directory or Hugging Face repo id."),
    ("--revision", "revision", str, "Model revision (HF cache snapshots)."),
    ("--served-model-name", "served_model_name", str, "Name SGLang puts in page file names."),
    ("--kv-cache-dtype", "kv_cache_dtype", str, "KV cache dtype (auto, bf16, fp8_e4m3, …)."),
    ("--page-size", "page_size", int, "Tokens per page (absent: SGLang resolves it on the GPU)."),
    ("--dtype", "dtype", str, "Model dtype (auto: from config.json)."),
    ("--quantization", "quantization", str, "Load-time quantization method."),
    ("--tp-size", "tp_size", int, "Tensor parallel size."),
    ("--pp-size", "pp_size", int, "Pipeline parallel size."),
    ("--attn-dp-size", "attn_dp_size", int, "Attention data parallel size."),
    ("--attn-cp-size", "attn_cp_size", int, "Attention context parallel size."),
    ("--dcp-size", "dcp_size", int, "Decode context parallel size."),
    ("--draft-model-path", "speculative_draft_model_path", str, "Speculative draft model."),
    ("--draft-model-revision", "speculative_draft_model_revision", str, "Draft revision."),
    ("--draft-quantization", "speculative_draft_model_quantization", str, "Draft quantization."),
    ("--draft-kv-cache-dtype", "speculative_draft_kv_cache_dtype", str, "Draft KV dtype."),
    ("--mamba-ssm-dtype", "mamba_ssm_dtype", str, "Mamba SSM state dtype."),
    ("--hicache-mem-layout", "hicache_mem_layout", str, "HiCache memory layout."),
]


@dataclass(frozen=True)
class LaunchRequest:
    """What the shared options said: explicit SGLang values, the launch command, identity knobs."""

    overrides: dict[str, Any]
    command: tuple[str, ...]
    fast: bool = False
    sglang_version: str | None = None
    vllm_version: str | None = None
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_vllm(self) -> bool:
        """Whether the launch command starts vLLM rather than SGLang."""
        return is_vllm_launch(self.command)

    def launch_args(self) -> LaunchArgs:
        """The SGLang settings: the launch command's values with explicit options on top."""
        if "args" not in self._cache:
            self._cache["args"] = resolve_launch_args(self.command, self.overrides)
        args: LaunchArgs = self._cache["args"]
        return args

    def vllm_args(self) -> VllmLaunchArgs:
        """The vLLM settings of the launch command (the server's environment included)."""
        if "vllm" not in self._cache:
            given = sorted(k for k, v in self.overrides.items() if v is not None)
            if given:
                flag = "--" + given[0].replace("_", "-")
                raise ConfigError(f"{flag} is an SGLang option: put vLLM's in its command")
            self._cache["vllm"] = resolve_vllm_args(self.command, dict(os.environ))
        args: VllmLaunchArgs = self._cache["vllm"]
        return args

    def engine_args(self) -> LaunchArgs | VllmLaunchArgs:
        """The launch's settings, for whichever engine it starts."""
        return self.vllm_args() if self.is_vllm else self.launch_args()

    def identity_options(self, settings: Settings) -> IdentityOptions:
        """Identity knobs: these options, and the settings (--salt and the granularity are
        settings flags, so they are in `settings` already)."""
        return IdentityOptions(
            salt=settings.identity_salt,
            fast=self.fast,
            sglang_version=self.sglang_version,
            vllm_version=self.vllm_version,
            version_granularity=settings.sglang_version_granularity,
            hash_workers=settings.hash_workers,
        )

    def compute_identity(self, settings: Settings, *, writes: bool = False) -> AnyIdentity:
        """The identity, with a progress bar on a terminal and the root's digest cache: `init`
        (`writes`) keeps what it hashed there; `fingerprint` reads a copy of it, if the root
        has a state DB, and writes nothing (the identity does not depend on a root)."""
        layout = Layout.at(settings.root, settings.state_dir)
        if writes:
            create_root(layout)
            with Store.open(layout.db_path) as store:
                return self._compute(settings, DigestCache(store))
        try:
            with snapshot(layout.db_path) as copy:
                return self._compute(settings, DigestCache(copy))
        except (OSError, sqlite3.Error, CachemgrError) as e:  # unreadable, newer: no cache
            log.debug("digest cache not used", extra={"error": str(e)})
            return self._compute(settings, None)

    def _compute(self, settings: Settings, cache: DigestCache | None) -> AnyIdentity:
        if self.is_vllm:
            return compute_vllm_identity(
                self.vllm_args(),
                self.identity_options(settings),
                cache=cache,
                progress=terminal_progress,
                installed=self._installed("vllm", installed_vllm_version, cache),
            )
        return compute_identity(
            self.launch_args(),
            self.identity_options(settings),
            cache=cache,
            progress=terminal_progress,
            installed=self._installed("sglang", installed_sglang_version, cache),
        )

    def _installed(
        self, dist: str, here: Callable[[], str | None], cache: DigestCache | None
    ) -> Callable[[], str | None]:
        """The engine's version as the launch's own Python has it (the engine's venv), else
        as this one has it."""
        python = launch_python(self.command, os.environ)

        def version() -> str | None:
            found = installed_version(python, dist, cache) if python is not None else None
            return found or here()

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
    names = [name for _, name, _, _ in _SGLANG_OPTIONS]

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        overrides = {name: kwargs.pop(name) for name in names}
        kwargs["launch"] = LaunchRequest(
            overrides=overrides,
            command=tuple(kwargs.pop("launch_cmd")),
            fast=kwargs.pop("fast"),
            sglang_version=kwargs.pop("sglang_version"),
            vllm_version=kwargs.pop("vllm_version"),
        )
        return f(*args, **kwargs)

    decorators = [
        click.argument("launch_cmd", nargs=-1, type=click.UNPROCESSED, metavar="[-- LAUNCH_CMD…]"),
        setting_option(
            "--sglang-version-granularity",
            setting="sglang_version_granularity",
            type=click.Choice(["major.minor", "full", "none"]),
            help="How much of the SGLang (or vLLM) version counts (default major.minor).",
        ),
        click.option("--sglang-version", help="SGLang version (default: the installed one)."),
        click.option("--vllm-version", help="vLLM version (default: the installed one)."),
        click.option("--fast", is_flag=True, help="Hash safetensors headers + sizes only."),
        setting_option(
            "--salt", setting="identity_salt", help="Operator salt mixed into the identity."
        ),
        *(
            click.option(opt, name, type=typ, default=None, help=help_)
            for opt, name, typ, help_ in reversed(_SGLANG_OPTIONS)
        ),
    ]
    decorated: Callable[..., Any] = wrapper
    for deco in decorators:
        decorated = deco(decorated)
    return decorated  # type: ignore[return-value]
