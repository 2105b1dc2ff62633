"""The one settings object: defaults < TOML config file < CACHEMGR_* env < CLI flags."""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import tomllib
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import timedelta
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    BeforeValidator,
    ByteSize,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from cachemgr.errors import ConfigError, NotFoundError
from cachemgr.layout import STATE_DIR
from cachemgr.units import parse_duration, whole_bytes

ENV_PREFIX = "CACHEMGR_"
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["auto", "json", "text"]
Source = Literal["flag", "env", "file", "default"]

Duration = Annotated[timedelta, BeforeValidator(parse_duration)]
Bytes = Annotated[ByteSize, BeforeValidator(whole_bytes)]

# Bounds that keep a value from breaking what uses it: past 100 years a duration overflows the
# datetime arithmetic of every command; SQLite holds byte counts as signed 64-bit integers.
HUNDRED_YEARS = timedelta(days=36525)
HUNDRED_YEARS_SECONDS = HUNDRED_YEARS.total_seconds()
MAX_BYTES = 2**63 - 1
# The shortest each duration may be: 0 for an age or a TTL; a period run in a loop is at least
# 0.1 s (0 would busy-loop a core).
_DURATION_FLOORS = {
    "gc_unbound_ttl": timedelta(0),
    "gc_tmp_ttl": timedelta(0),
    "gc_min_age": timedelta(0),
    "gc_interval": timedelta(seconds=0.1),
    "gc_sweep_interval": timedelta(seconds=0.1),
}

_INTEGER = re.compile(r"\s*[+-]?[0-9]+(_[0-9]+)*\s*")  # what int() reads, less the decimals
# The config file path is known only at run time (a CLI flag), but pydantic-settings builds
# its sources from the class; a context variable hands the path to the file source.
_config_file: ContextVar[Path | None] = ContextVar("cachemgr_config_file", default=None)
log = logging.getLogger(__name__)
# Old setting name -> new one. The old name is still read (keyword, TOML key, env var, the
# CLI's flag) with one deprecation line per process.
RENAMED = {"sglang_version_granularity": "engine_version_granularity"}
_warned: set[str] = set()


def warn_renamed(old: str, new: str) -> None:
    """The one deprecation line for an old name still in use (once per process)."""
    if old not in _warned:
        _warned.add(old)
        log.warning(f"{old} is deprecated: use {new}", extra={"old": old, "new": new})


def default_root() -> Path:
    """Where the cache root lives when nobody says: the user's XDG cache directory."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cachemgr"


class Settings(BaseSettings):
    """Everything cachemgr can be told; built once at start and passed down."""

    # No inf or nan: "inf" seconds between polls is a sleep that raises, nan passes no bound.
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", frozen=True, allow_inf_nan=False
    )

    root: Path = Field(default_factory=default_root, description="cache root directory")
    state_dir: Path | None = Field(
        None, description="state DB directory (default <root>/.cachemgr)"
    )
    host: str = Field("127.0.0.1", min_length=1, description="HTTP bind address")
    port: int = Field(9477, ge=0, le=65535, description="HTTP port (0 picks a free one)")
    token: SecretStr | None = Field(None, description="bearer token for mutating HTTP routes")
    log_level: LogLevel = Field(
        "info",
        description="log threshold of `serve`; the other commands log only warnings and their "
        "progress unless it is given",
    )
    log_format: LogFormat = Field("auto", description="json, text, or auto (text on a terminal)")
    # --- identity ---
    identity_salt: str = Field(
        "",
        description="operator salt mixed into every identity (change it to force new namespaces)",
    )
    engine_version_granularity: Literal["major.minor", "full", "none"] = Field(
        "major.minor",
        description="how much of the engine's (SGLang's, vLLM's) version is part of the identity",
    )
    hash_workers: int = Field(
        0, ge=0, le=64, description="threads hashing model files (0: cores + 1, at most 8)"
    )
    # --- init and purge ---
    instance: str = Field(
        "default", description="name of the server instance `init`/`exec` bind to a namespace"
    )
    on_change: Literal["purge", "retain"] = Field(
        "purge",
        description="when an instance's identity changes: purge its old namespace (unless "
        "another instance uses it) or retain it for a quick switch back",
    )
    # --- daemon ---
    batch_interval: float = Field(
        0.25, ge=0.01, le=10, description="seconds between applying watcher events to the index"
    )
    reconcile_interval: float = Field(
        600.0,
        ge=0,
        le=HUNDRED_YEARS_SECONDS,
        description="seconds between full rescans that bound index drift (0: never)",
    )
    sglang_url: str | None = Field(
        None, description="SGLang server base URL to scrape /metrics and check /server_info"
    )
    sglang_poll_interval: float = Field(
        15.0, ge=0.01, le=86400, description="seconds between polls of the SGLang server"
    )
    http_max_connections: int = Field(
        1024,
        ge=8,
        le=1_000_000,
        description="open HTTP connections at most (fewer if RLIMIT_NOFILE less the reserve "
        "leaves less room); at the cap a new one replaces the oldest idle one",
    )
    http_fd_reserve: int = Field(
        256,
        ge=64,
        le=1_000_000,
        description="file descriptors no HTTP connection may take: the index, watcher, SQLite "
        "and GC's",
    )
    http_header_timeout: float = Field(
        5.0,
        ge=0.5,  # shorter, a request split over two packets (a slow link, a proxy) is cut off
        le=300,
        description="seconds a client has to send a whole request once it connects or starts "
        "one (slow or half-sent requests are closed)",
    )
    http_keep_alive_timeout: int = Field(
        5, ge=1, le=300, description="seconds an idle keep-alive HTTP connection stays open"
    )
    # --- gc ---
    gc_max_bytes: Bytes | None = Field(
        None,
        le=MAX_BYTES,
        description='cap on the page bytes of all namespaces under the root ("500GB")',
    )
    gc_namespace_max_bytes: Bytes | None = Field(
        None, le=MAX_BYTES, description="cap on the page bytes of any one namespace"
    )
    gc_min_free_bytes: Bytes = Field(
        ByteSize(0),
        le=MAX_BYTES,
        description="keep at least this much free on the root's filesystem",
    )
    gc_min_free_percent: float = Field(
        5.0, ge=0, lt=100, description="keep at least this percent of the filesystem free"
    )
    gc_max_files: int | None = Field(
        None, ge=1, le=10**12, description="cap on the page files of all namespaces under the root"
    )
    gc_namespace_max_files: int | None = Field(
        None,
        ge=1,
        le=10**12,
        description="cap on the page files of any one namespace (a flat one on an ext4 without "
        "large_dir: at most 80% of the entries its dir can take, also when unset)",
    )
    gc_min_free_inodes_percent: float = Field(
        5.0, ge=0, lt=100, description="keep at least this percent of the filesystem's inodes free"
    )
    gc_high_watermark: float = Field(
        0.95, gt=0, le=1, description="start evicting above this fraction of a cap"
    )
    gc_low_watermark: float = Field(
        0.85, gt=0, lt=1, description="evict down to this fraction of a cap"
    )
    gc_keep_unbound: int = Field(
        2,
        ge=0,
        le=1_000_000,
        description="keep this many most recent namespaces no server is bound to",
    )
    gc_unbound_ttl: Duration | None = Field(
        timedelta(days=7), description="drop an unbound namespace idle for longer than this"
    )
    gc_tmp_ttl: Duration = Field(
        timedelta(hours=1), description="remove SGLang .tmp files older than this (crashed writes)"
    )
    # 0 by default: SGLang writes a page to a temp file and renames it (never a torn page), and
    # a page unlinked while a reader has it open reads whole (tests/test_gc_sglang.py).
    gc_min_age: Duration = Field(
        timedelta(0), description="never delete a page written or read more recently"
    )
    gc_interval: Duration = Field(
        timedelta(seconds=60), description="how often the daemon checks whether GC is needed"
    )
    gc_sweep_interval: Duration = Field(
        timedelta(hours=1), description="how often GC lists namespace dirs for temp and torn files"
    )
    gc_delete_rate: float | None = Field(
        2000.0,
        ge=1,
        le=1e9,
        description="files deleted per second at most (unset: as fast as the disk)",
    )

    # --- fleet (off unless fleet_coordinator is set: docs/fleet.md) ---
    fleet_coordinator: str | None = Field(
        None,
        description='the GC leader\'s lease: "etcd://HOST:PORT[,HOST:PORT...]" (etcd v3) or '
        '"kubernetes" (a coordination.k8s.io Lease); unset: no fleet, this node alone',
    )
    node_name: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="this node's name in the fleet (default: the hostname)",
    )
    fleet_lease_name: str = Field(
        "cachemgr-gc",
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        max_length=253,
        description="the lease one shared root's nodes elect their GC leader with (one per root)",
    )
    fleet_lease_namespace: str | None = Field(
        None, description="Kubernetes namespace of the Lease (default: the pod's own)"
    )
    fleet_lease_ttl: float = Field(
        10.0, ge=2, le=300, description="seconds the GC leader's lease outlives its last renewal"
    )
    fleet_renew_interval: float = Field(
        2.0, ge=0.1, le=100, description="seconds between lease renewals (and campaigns)"
    )
    fleet_advertise_url: str | None = Field(
        None,
        description="the URL other nodes reach this daemon at (default http://<host>:<port>, "
        "the hostname when bound to all addresses)",
    )
    fleet_buffer: int = Field(
        100_000,
        ge=1000,
        le=10_000_000,
        description="accesses a follower keeps for the leader at most (the oldest are dropped)",
    )

    @field_validator("root", "state_dir", mode="before")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        # Path("") is ".", so an empty value from a flag, env var or file would quietly mean
        # "the current directory".
        if isinstance(value, str) and not value.strip():
            raise ValueError("must not be empty (give a directory, e.g. /var/cache/cachemgr)")
        # A CRLF env file or a stray space would serve a new, empty dir beside the real one
        # while the engine writes to the real one: refused, not trimmed (a name may have them).
        if isinstance(value, str) and value != value.strip():
            raise ValueError("starts or ends with whitespace (a CRLF env file?): remove it")
        return value

    @field_validator("gc_max_bytes", "gc_namespace_max_bytes")
    @classmethod
    def _cap_not_zero(cls, value: ByteSize | None) -> ByteSize | None:
        # Often meant as "no cap"; it would evict every page.
        if value == 0:
            raise ValueError("0 would evict every page: leave it unset for no cap")
        return value

    @field_validator("token", mode="before")
    @classmethod
    def _token_stripped(cls, value: Any) -> Any:
        # A token read from a file keeps its newline (`kubectl create secret --from-file`,
        # `$(cat f)` does not, an env file may), and HTTP strips a header's surrounding
        # whitespace: one that cannot match any request. Stripped here, for the daemon and
        # every client reading the same setting; blank is no token (refused off loopback).
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        if isinstance(value, str):
            return value.strip() or None
        return value

    @field_validator(
        "port",
        "hash_workers",
        "http_max_connections",
        "http_fd_reserve",
        "http_keep_alive_timeout",
        "gc_max_files",
        "gc_namespace_max_files",
        "gc_keep_unbound",
        "fleet_buffer",
        mode="before",
    )
    @classmethod
    def _whole_number(cls, value: Any) -> Any:
        # pydantic reads "1.0" (and 1.0) as 1: CACHEMGR_PORT=1.0 would serve on port 1, and
        # CACHEMGR_GC_MAX_FILES=1.0 was a cap of one file, a GC that deleted the whole cache.
        if isinstance(value, float) or (isinstance(value, str) and not _INTEGER.fullmatch(value)):
            raise ValueError("must be a whole number, without a decimal point")
        return value

    @field_validator("gc_low_watermark")
    @classmethod
    def _low_below_high(cls, low: float, info: ValidationInfo) -> float:
        high = info.data.get("gc_high_watermark")
        if high is not None and low >= high:
            raise ValueError(f"must be below gc_high_watermark ({high})")
        return low

    @field_validator(*_DURATION_FLOORS)
    @classmethod
    def _duration_in_range(cls, value: timedelta | None, info: ValidationInfo) -> Any:
        floor = _DURATION_FLOORS[info.field_name or ""]
        if value is None:
            return value
        if value < floor:
            raise ValueError(
                "must not be negative"
                if not floor
                else f"must be at least {floor.total_seconds():g}s"
            )
        if value > HUNDRED_YEARS:
            raise ValueError("must be at most 100 years (36525d)")
        return value

    @field_validator("reconcile_interval")
    @classmethod
    def _never_or_a_second(cls, value: float) -> float:
        # A full rescan lists every file under the root: more often than once a second is a
        # rescan that never ends.
        if 0 < value < 1:
            raise ValueError("must be 0 (never) or at least 1 second")
        return value

    @field_validator("fleet_coordinator")
    @classmethod
    def _coordinator(cls, value: str | None) -> str | None:
        if value is not None and value != "kubernetes" and not value.startswith("etcd://"):
            raise ValueError('must be "etcd://HOST:PORT[,HOST:PORT...]" or "kubernetes"')
        return value

    @field_validator("fleet_renew_interval")
    @classmethod
    def _renew_within_ttl(cls, value: float, info: ValidationInfo) -> float:
        # Two renewals per lease at least: one lost request must not cost the lease.
        ttl = info.data.get("fleet_lease_ttl")
        if ttl is not None and value > ttl / 2:
            raise ValueError(f"must be at most half of fleet_lease_ttl ({ttl:g}s)")
        return value

    @field_validator("sglang_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"https?://[^/\s]", value):
            raise ValueError('must be an http:// or https:// URL, e.g. "http://127.0.0.1:30000"')
        return value

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        """An old setting name (a keyword or a TOML key) as its new one; the new one wins."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for old, new in RENAMED.items():
            if old in data:
                warn_renamed(f"setting {old}", new)
                value = data.pop(old)
                data.setdefault(new, value)
        return data

    @property
    def state_path(self) -> Path:
        """The directory holding the state DB and locks."""
        return self.state_dir if self.state_dir is not None else self.root / STATE_DIR

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        renamed = _RenamedEnvSource(settings_cls)
        return (init_settings, env_settings, renamed, _TomlFileSource(settings_cls))


class _RenamedEnvSource(PydanticBaseSettingsSource):
    """CACHEMGR_<old name> variables, read as the new setting, below its own variable."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError  # __call__ below returns the whole mapping at once

    def __call__(self) -> dict[str, Any]:
        upper = {k.upper(): v for k, v in os.environ.items()}
        found = {}
        for old, new in RENAMED.items():
            name = ENV_PREFIX + old.upper()
            if name in upper:
                warn_renamed(f"environment variable {name}", ENV_PREFIX + new.upper())
                found[new] = upper[name]
        return found


class _TomlFileSource(PydanticBaseSettingsSource):
    """Reads the `[cachemgr]` table (or the top level) of the TOML config file, if any."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError  # __call__ below returns the whole mapping at once

    def __call__(self) -> dict[str, Any]:
        path = _config_file.get()
        if path is None:
            return {}
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            cls = NotFoundError if isinstance(e, FileNotFoundError) else ConfigError
            raise cls(f"config file {path}: {e.strerror or e}") from e
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path}: not valid TOML ({e})") from e
        table = data.get("cachemgr", data)
        if not isinstance(table, dict):
            raise ConfigError(f"config file {path}: [cachemgr] must be a table")
        stray = sorted(k for k in data if k != "cachemgr") if table is not data else []
        if stray:  # (read as settings only without the table: here they would be ignored)
            raise ConfigError(
                f"config file {path}: {', '.join(stray)} outside the [cachemgr] table: "
                "move the settings into it"
            )
        for name, value in table.items():
            if name in Settings.model_fields:
                _check_toml_type(name, value, path)
        return table


# What a TOML value may be for each type of setting. TOML has types, so the file is held to
# them: pydantic would read `port = true` as port 1 (env vars and flags are text, parsed as is).
_TOML_TYPES: dict[Any, tuple[tuple[type, ...], str]] = {
    int: ((int,), "an integer"),
    float: ((int, float), "a number"),
    ByteSize: ((int, str), 'a size: a number of bytes or a string such as "500GB"'),
    timedelta: ((int, float, str), 'a duration: seconds or a string such as "5m"'),
}


def _check_toml_type(name: str, value: Any, path: Path) -> None:
    """Refuse a TOML value of the wrong type for setting `name`, in one line naming both."""
    annotation = Settings.model_fields[name].annotation
    if get_origin(annotation) in (Union, UnionType):  # X | None: TOML has no null
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    if get_origin(annotation) is Annotated:  # Bytes, Duration: the type under the validator
        annotation = get_args(annotation)[0]
    kinds, wanted = _TOML_TYPES.get(annotation, ((str,), "a string"))
    if isinstance(value, bool) or not isinstance(value, kinds):
        shown = json.dumps(value, default=str)
        raise ConfigError(f"invalid {name} in {path}: {shown}: must be {wanted}")


def load_settings(
    config_file: Path | None = None, *, flags: Mapping[str, str] | None = None, **overrides: Any
) -> Settings:
    """Build the settings from all sources; a bad value raises ConfigError naming the field
    and the ways to set it: its env var, the config file, and `flags[field]` (the CLI's text
    for the flags that exist for it; a setting without one names none)."""
    token = _config_file.set(config_file)
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as e:
        raise ConfigError(_describe(e, config_file, flags or {})) from None
    finally:
        _config_file.reset(token)


def one_off(settings: Settings, overrides: dict[str, Any]) -> Settings:
    """`settings` with `overrides` (by setting name), checked as load_settings checks a flag;
    raises pydantic's ValidationError, whose locations name the settings. No source is read
    again: the environment and the file said what they say in `settings`."""
    return Settings.model_validate({**settings.model_dump(), **overrides})


def setting_sources(config_file: Path | None, overrides: dict[str, Any]) -> dict[str, Source]:
    """Where each setting's value came from, by the precedence load_settings applies."""
    token = _config_file.set(config_file)
    try:
        from_file = _TomlFileSource(Settings)()
    finally:
        _config_file.reset(token)
    from_env = {**_RenamedEnvSource(Settings)(), **EnvSettingsSource(Settings)()}
    from_file = {RENAMED.get(k, k): v for k, v in from_file.items()}
    flags = {k for k, v in overrides.items() if v is not None}

    def source(name: str) -> Source:
        if name in flags:
            return "flag"
        return "env" if name in from_env else "file" if name in from_file else "default"

    return {name: source(name) for name in Settings.model_fields}


# CACHEMGR_* variables that are not settings: the config file's path (a global flag's env),
# what `init`/`exec` hand a vLLM launch (cachemgr.vllm.rewrite), and the engine envs the
# tests, scripts and bench use.
OTHER_ENV_VARS = frozenset(
    {
        "CACHEMGR_CONFIG",
        "CACHEMGR_VLLM_ROOT_DIR",
        "CACHEMGR_VLLM_KV_TRANSFER_CONFIG",
        "CACHEMGR_SGLANG_ENV",
        "CACHEMGR_VLLM_ENV",
    }
)


def unknown_env_vars(environ: Mapping[str, str]) -> list[str]:
    """One line per CACHEMGR_* variable cachemgr does not read, with the name it may mean.

    A misspelt variable is otherwise ignored in silence, while the same typo in the TOML
    file is an error; env names are case-insensitive, as pydantic-settings reads them.
    """
    names = [*Settings.model_fields, *RENAMED]
    known = {ENV_PREFIX + name.upper() for name in names} | OTHER_ENV_VARS
    lines = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in known:
            continue
        # Compared without the prefix they all share, which would make any two names close.
        tails = sorted(k.removeprefix(ENV_PREFIX) for k in known)
        close = difflib.get_close_matches(upper.removeprefix(ENV_PREFIX), tails, n=1, cutoff=0.75)
        hint = f"; did you mean {ENV_PREFIX}{close[0]}?" if close else " (not a cachemgr setting)"
        lines.append(f"environment variable {name} is ignored{hint}")
    return lines


def _describe(error: ValidationError, config_file: Path | None, flags: Mapping[str, str]) -> str:
    """One line for the first problem: the field, where it can come from, the value, the rule."""
    first = error.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "settings"
    ways = [*([flags[field]] if field in flags else []), f"env {ENV_PREFIX}{field.upper()}"]
    if config_file:
        ways.append(f"or {config_file}")
    where = f"{field} ({', '.join(ways)})"
    if first["type"] == "extra_forbidden":
        return f"unknown setting {field!r}" + (f" in {config_file}" if config_file else "")
    value = first.get("input")
    return f"invalid {where}: {value!r}: {first['msg']}"
