"""The one interface every engine implements: what cachemgr needs to know about a server.

An engine is a package (cachemgr/sglang/, cachemgr/vllm/) whose `engine.py` holds one object
of this type; cachemgr.engines registers them. The CLI, doctor, init and the daemon ask that
object and name no engine: the file format of its cache, how its launch command reads and where
it is pointed at a namespace dir, its identity record and how it is computed, doctor's lint, and
the probe of its running server, if it has one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from prometheus_client.metrics_core import Metric

from cachemgr.backends import FileFormat
from cachemgr.doctor.finding import Finding
from cachemgr.formats import EngineName
from cachemgr.gc.policy import GcPolicy
from cachemgr.identity.digest_cache import DigestCache
from cachemgr.identity.fingerprint import IdentityOptions, ProgressFactory
from cachemgr.identity.record import Digested
from cachemgr.layout import Layout
from cachemgr.settings import Settings
from cachemgr.worker import DeathHandler, Worker

ArgsT = TypeVar("ArgsT")
Installed = Callable[[], str | None]


@dataclass(frozen=True)
class IdentityFlag:
    """A CLI option that sets one launch setting when there is no launch command to read."""

    option: str  # "--model-path"
    field: str  # the launch args' field it sets
    value_type: type
    help: str


MismatchHandler = Callable[[str, list[str]], None]
# The state DB sits above the engines: the daemon passes the lookup of the namespace the
# instance is bound to, as (id, identity_json, indexed pages) (cachemgr.state.registry_sql).
BoundLookup = Callable[[str], tuple[str, str, int] | None]


@dataclass(frozen=True)
class ProbeHooks:
    """What the daemon hands an engine's probe: the instance it watches, the lookup of that
    instance's namespace, and what to do when the server contradicts the namespace."""

    instance: str
    bound: BoundLookup
    on_mismatch: MismatchHandler  # the daemon purges that namespace
    on_death: DeathHandler | None = None


@dataclass
class ProbeState:
    """What the daemon last learnt from the engine's running server (read by /metrics)."""

    up: bool = False
    namespace: str | None = None  # the namespace the server was matched to
    mismatches: int = 0  # identity contradictions found (each one purged its namespace)
    alarm: bool = False  # the last check found a contradiction or an ambiguity (no purge)
    last_error: str | None = None


class Probe(Worker, ABC):
    """The daemon's worker that polls an engine's running server: `state` for the daemon, and
    the engine's own metrics of that server."""

    state: ProbeState

    @abstractmethod
    def families(self) -> Iterator[Metric]:
        """The server's metrics as last polled; the engine's `probe_metrics` document them."""


class Engine(ABC, Generic[ArgsT]):
    """One engine: `ArgsT` is what its launch command resolves to."""

    name: ClassVar[EngineName]  # its identity record's `engine` key (cachemgr.formats)
    label: ClassVar[str]  # as people write it: "SGLang"
    distribution: ClassVar[str]  # the Python package whose version is in the identity
    version_example: ClassVar[str]  # for the hint to pass one
    format: ClassVar[FileFormat]
    record: ClassVar[type[Digested]]
    server_env_vars: ClassVar[tuple[str, ...]]  # the names `server_env` sets
    # Options that describe a launch without its command (`init --model-path M`).
    identity_flags: ClassVar[tuple[IdentityFlag, ...]] = ()
    # (name, help) of each metric its probe shows, for /metrics' documented names.
    probe_metrics: ClassVar[Mapping[str, str]] = {}

    @property
    def version_option(self) -> str:
        """The CLI option that gives the engine's version explicitly."""
        return f"--{self.name}-version"

    @abstractmethod
    def claims(self, command: Sequence[str]) -> bool:
        """Whether `command` starts this engine's server."""

    @abstractmethod
    def launch_args(
        self, command: Sequence[str], overrides: Mapping[str, Any], environ: Mapping[str, str]
    ) -> ArgsT:
        """The launch's settings as the engine reads them, `overrides` (identity flags) on top."""

    def check_launch(
        self,
        args: ArgsT,
        command: Sequence[str],
        environ: Mapping[str, str],
        *,
        plugin_values: frozenset[str],
    ) -> None:
        """Refuse (ConfigError) a launch cachemgr cannot manage or the engine would not start,
        before init touches the root; `plugin_values` (--plugin-value) are values of the
        launch a plugin of the engine registers, not refused as ones it does not ship."""

    @abstractmethod
    def installed_version(self) -> str | None:
        """The engine's version as this Python has it installed, if it does."""

    @abstractmethod
    def compute_identity(
        self,
        args: ArgsT,
        options: IdentityOptions,
        *,
        cache: DigestCache | None,
        progress: ProgressFactory | None,
        installed: Installed,
    ) -> Digested:
        """The identity of the server `args` start, its model files read from disk."""

    @abstractmethod
    def server_env(
        self, command: Sequence[str], storage_dir: Path, environ: Mapping[str, str]
    ) -> dict[str, str]:
        """The variables that hand the server its namespace dir (`init --print-env`)."""

    @abstractmethod
    def server_launch(
        self, command: Sequence[str], storage_dir: Path, environ: Mapping[str, str]
    ) -> tuple[list[str], dict[str, str]]:
        """(argv, environment) that start the server on its namespace dir (`exec`)."""

    def rewritten_command(
        self, command: Sequence[str], storage_dir: Path, environ: Mapping[str, str]
    ) -> list[str] | None:
        """The launch rewritten to use the namespace dir, when the dir is in its command."""
        return None

    def identity_warnings(self, identity: Digested) -> list[str]:
        """What the identity itself tells the operator (a file recorded as unread), said by
        every command that computes it, as the launch's other warnings are."""
        return []

    @abstractmethod
    def init_warnings(
        self,
        args: ArgsT,
        storage_dir: Path,
        *,
        layout: Layout,
        environ: Mapping[str, str],
        hands_env: bool,
    ) -> list[str]:
        """What `init` warns about the launch's own storage settings; `hands_env`: init
        prints or writes the variables of `server_env`."""

    def exec_refusal(self, args: ArgsT, *, layout: Layout, environ: Mapping[str, str]) -> None:
        """ConfigError when a setting would send the server somewhere no namespace of this
        root is: `exec` asks before init creates, binds or purges anything."""

    @abstractmethod
    def exec_warnings(
        self, args: ArgsT, storage_dir: Path, *, layout: Layout, environ: Mapping[str, str]
    ) -> list[str]:
        """What `exec` warns about before it starts the server."""

    @abstractmethod
    def lint(
        self,
        command: Sequence[str],
        *,
        layout: Layout,
        policy: GcPolicy,
        identity: Callable[[], Digested | None],
        environ: Mapping[str, str],
    ) -> list[Finding]:
        """Doctor's findings for a launch; `identity` computes its identity (None if it
        cannot here), `policy` holds the GC limits on the root."""

    def probe(self, settings: Settings, hooks: ProbeHooks) -> Probe | None:
        """The worker that watches this engine's server, when `settings` name one; None when
        they do not, or the engine has no probe."""
        return None
