"""The HTTP API's request and response bodies (pydantic): what api/openapi.json describes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import Path
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic.json_schema import SkipJsonSchema

from cachemgr import __version__
from cachemgr.gc.policy import GcReason
from cachemgr.gc.step import Unmet
from cachemgr.layout import INSTANCE_RE, NS_ID_RE
from cachemgr.ns.status import NamespaceStatus

# Anchored: JSON Schema (and pydantic) patterns match anywhere in the string.
NS_ID_PATTERN = f"^{NS_ID_RE.pattern}$"
INSTANCE_PATTERN = f"^{INSTANCE_RE.pattern}$"
NsId = Annotated[str, Path(pattern=NS_ID_PATTERN, description="namespace id (16 hex digits)")]


class Problem(BaseModel):
    """An RFC 9457 problem detail."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str | None = None
    instance: str | None = None
    errors: list[dict[str, Any]] | None = None
    allow: list[str] | None = None  # with a 405: the methods the route takes
    hint: str | None = None
    error_id: str | None = None  # with a 500: the id of its log line, which has the cause


class Health(BaseModel):
    status: str
    version: str = __version__


class Readiness(BaseModel):
    ready: bool
    detail: str


class IndexInfo(BaseModel):
    """The live index: how it was built and whether it keeps up."""

    ready: bool
    settled: bool = Field(
        description="the index matched the disk since the start and GC's model of its pages is "
        "built: GC's runs wait for it (a restart from the model file is ready first, then scans "
        "what changed while down; a first start is ready once indexed, then loads the model)"
    )
    leader: bool = Field(description="this daemon watches and writes the index; others follow")
    scans: int
    last_scan_seconds: float
    drift_pages: int
    overflows: int
    events_applied: int
    lag_seconds: float
    watches_refused: int = Field(
        description="dirs the kernel refused an inotify watch since the start "
        "(fs.inotify.max_user_watches): seen by the reconcile scans only, which retry the watch"
    )
    watch_refused_at: float | None = Field(description="unix time of the latest such refusal")
    watch_refused_namespaces: int = Field(
        description="namespaces with a dir refused a watch and not watched since"
    )
    watch_root_refused: bool = Field(
        description="<root>/ns itself refused its watch and not watched since: new namespace "
        "dirs are found by the reconcile scans only"
    )


class Totals(BaseModel):
    namespaces: int
    pages: int = Field(description="of the namespaces counted (one with null pages is not)")
    bytes: int = Field(description="of the namespaces counted (one with null bytes is not)")
    page_reads: int
    page_writes: int


class Status(BaseModel):
    """The daemon's view: per-namespace status plus totals, the index and the filesystem."""

    root: str
    version: str = __version__
    started_at: float | None
    uptime_seconds: float | None
    namespaces: list[NamespaceStatus]
    totals: Totals
    index: IndexInfo | None
    filesystem_avail_bytes: int | None
    filesystem_size_bytes: int | None
    gc_limits: GcLimits | None = Field(
        None, description="the limits this daemon's GC keeps (null: it runs no GC)"
    )
    gc_unmet: list[GcUnmet] = Field(
        default_factory=list,
        description="limits this daemon's last GC run left over their high watermark with "
        "nothing else it may delete (empty: all held, or no run yet)",
    )
    gc_model_keys_in_memory: int = Field(
        0,
        description="page keys GC's model holds in the daemon's memory (~33 bytes each) "
        "because their file in the state dir cannot be written (its filesystem full or "
        "read-only); 0 while the file takes them",
    )
    left_for_a_person: list[str] = Field(
        default_factory=list,
        description="purged namespaces in .trash/ that deletion cannot finish (foreign files): "
        "`.trash/<entry>: left for a person: N foreign files, e.g. <path>`",
    )


class GcUnmet(BaseModel):
    """A limit a GC run left over its high watermark, with nothing else it may delete."""

    limit: GcReason = Field(description="cap, free_space, files, free_inodes or dir_full")
    namespace_id: str | None = Field(description="null: the root's limit")
    unit: Literal["bytes", "files"]
    excess: int = Field(description="what would still have to go, to its low watermark")
    message: str

    @classmethod
    def of(cls, u: Unmet) -> GcUnmet:
        """The JSON shape of one unmet limit."""
        return cls(
            limit=u.reason,
            namespace_id=u.namespace_id,
            unit=u.unit,
            excess=u.excess,
            message=u.line(),
        )


class Fingerprint(BaseModel):
    """The identity record of a namespace, as registered by `cachemgr init`."""

    namespace: str
    digest: str
    instances: list[str]
    identity: dict[str, Any]


class RequestBody(BaseModel):
    """A request body: what would otherwise read loosely into a real purge or GC is a 422."""

    # strict: the schema says boolean, so a JSON 0 or 0.0 is a 422, not a quiet `false`
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _no_nulls(cls, data: Any) -> Any:
        # {"namespace": null} would mean "nothing chosen", which purges everything.
        if isinstance(data, dict):
            nulls = sorted(k for k, v in data.items() if v is None)
            if nulls:
                raise ValueError(f"null is not a value for {', '.join(nulls)}: leave it out")
        return data


def _unset() -> Any:
    """An optional field's default, None, which its schema does not show (null is a 422)."""
    return Field(None, json_schema_extra=_drop_default)


def _drop_default(schema: dict[str, Any]) -> None:
    del schema["default"]


class PurgeRequest(RequestBody):
    """Which namespaces to purge: a namespace, an instance's (both: the union), or `all: true`.

    Nothing chosen, `all: false`, or `all` with a namespace or instance is a 400: a request
    that does not say "everything" never reaches it.
    """

    namespace: Annotated[str, Field(pattern=NS_ID_PATTERN)] | SkipJsonSchema[None] = _unset()
    instance: Annotated[str, Field(pattern=INSTANCE_PATTERN)] | SkipJsonSchema[None] = _unset()
    all: bool = False
    dry_run: bool = False

    def selector_problem(self) -> str | None:
        """Why this request chooses no namespace, or contradicts itself; None if it is clear."""
        given = self.model_fields_set
        chosen = [name for name in ("namespace", "instance") if name in given]
        if "all" in given and not self.all:
            return "all=false selects nothing: give all=true, a namespace or an instance"
        if self.all and chosen:
            return f"all=true contradicts {' and '.join(chosen)}: give one or the other"
        if not self.all and not chosen:
            return "nothing chosen to purge: give a namespace, an instance, or all=true"
        return None


class NamespacePurgeRequest(RequestBody):
    dry_run: bool = False


class PurgedNamespace(BaseModel):
    namespace: str
    pages: int
    bytes: int
    recreated: bool = Field(
        description="an instance is bound, or a running process on the daemon's host uses it "
        "as its storage dir: the dir came back empty"
    )


class PurgeResponse(BaseModel):
    """What a purge removed (or, with dry_run, would remove)."""

    dry_run: bool
    selector: str
    purged: list[PurgedNamespace]
    pages: int
    bytes: int
    message: str
    problems: list[str] = []  # namespaces left alone (a bad manifest, a symlink), and why


PurgeFn = Callable[[PurgeRequest], PurgeResponse]


def _integral(value: Any) -> Any:
    """5.0 as 5: JSON Schema counts it an integer, and strict mode would refuse it."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


ByteText = Annotated[
    Annotated[int, Field(ge=0)] | str,
    BeforeValidator(_integral),
    Field(description='bytes, or a size as settings take it ("10MB")'),
]
DurationText = Annotated[
    Annotated[float, Field(ge=0)] | str,
    Field(description='seconds, or a duration as settings take it ("2m", "1h30m")'),
]
# The settings' bounds, for the schema; the settings model checks them again (a test keeps
# the two the same).
Percent = Annotated[float, Field(ge=0, lt=100)]
Rate = Annotated[float, Field(ge=1, le=1e9)]
FileCount = Annotated[int, BeforeValidator(_integral), Field(ge=1, le=10**12)]


class GcRequest(RequestBody):
    """A GC run now: with dry_run, what it would delete (any daemon can answer that).

    The other fields are one-off limits for this run only, the limits `cachemgr gc` takes as
    flags, checked as the settings check them (a bad one is a 422 naming it); a limit left
    out is the daemon's own.
    """

    dry_run: bool = False
    max_bytes: ByteText | SkipJsonSchema[None] = _unset()
    namespace_max_bytes: ByteText | SkipJsonSchema[None] = _unset()
    min_free_bytes: ByteText | SkipJsonSchema[None] = _unset()
    max_files: FileCount | SkipJsonSchema[None] = _unset()
    namespace_max_files: FileCount | SkipJsonSchema[None] = _unset()
    min_free_percent: Percent | SkipJsonSchema[None] = _unset()
    min_free_inodes_percent: Percent | SkipJsonSchema[None] = _unset()
    min_age: DurationText | SkipJsonSchema[None] = _unset()
    tmp_ttl: DurationText | SkipJsonSchema[None] = _unset()
    delete_rate: Rate | SkipJsonSchema[None] = _unset()

    def limits(self) -> dict[str, Any]:
        """The one-off limits given, by their settings' names (gc_max_bytes, …)."""
        given = self.model_fields_set - {"dry_run"}
        return {f"gc_{name}": getattr(self, name) for name in sorted(given)}


class GcLimits(BaseModel):
    """The limits a daemon's GC keeps, from its settings: bytes, files, percent, seconds,
    files/s."""

    max_bytes: int | None
    namespace_max_bytes: int | None
    min_free_bytes: int
    max_files: int | None = None
    namespace_max_files: int | None = None
    min_free_percent: float
    min_free_inodes_percent: float = 0.0
    min_age_seconds: float
    tmp_ttl_seconds: float
    delete_rate: float | None = Field(description="files per second at most; null: unpaced")
