"""The HTTP API (FastAPI): health, metrics, status, purge and GC; errors as problem+json.

`python -m cachemgr.server --dump-openapi` prints the OpenAPI document that is committed as
api/openapi.json (a test fails when they differ).
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from cachemgr import __version__
from cachemgr.errors import CachemgrError, ConflictError, NotFoundError
from cachemgr.gcapi import GcResponse, gc_request
from cachemgr.gcrunner import GcRunner
from cachemgr.indexer import IndexState
from cachemgr.layout import NS_ID_RE, Layout
from cachemgr.metrics import Reader
from cachemgr.status import NamespaceStatus, disk_usage, namespace_statuses

PROBLEM = "application/problem+json"
PURGE_PATHS = ("/purge", "/v1/purge")
# Anchored: JSON Schema (and pydantic) patterns match anywhere in the string.
NS_ID_PATTERN = f"^{NS_ID_RE.pattern}$"
INSTANCE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"  # as namespaces.check_instance
NsId = Annotated[str, Path(pattern=NS_ID_PATTERN, description="namespace id (16 hex digits)")]


class Problem(BaseModel):
    """An RFC 9457 problem detail."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str | None = None
    instance: str | None = None
    errors: list[dict[str, Any]] | None = None
    hint: str | None = None


class Health(BaseModel):
    status: str
    version: str = __version__


class Readiness(BaseModel):
    ready: bool
    detail: str


class IndexInfo(BaseModel):
    """The live index: how it was built and whether it keeps up."""

    ready: bool
    scans: int
    last_scan_seconds: float
    drift_pages: int
    overflows: int
    events_applied: int
    lag_seconds: float


class Totals(BaseModel):
    namespaces: int
    pages: int
    bytes: int
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


class Fingerprint(BaseModel):
    """The identity record of a namespace, as registered by `cachemgr init`."""

    namespace: str
    digest: str
    instances: list[str]
    identity: dict[str, Any]


class PurgeRequest(BaseModel):
    """Which namespaces to purge: the union of what is chosen; nothing chosen means all."""

    # strict: the schema says boolean, so a JSON 0 or 0.0 is a 422, not a quiet `false`
    model_config = ConfigDict(extra="forbid", strict=True)

    namespace: str | None = Field(None, pattern=NS_ID_PATTERN)
    instance: str | None = Field(None, pattern=INSTANCE_PATTERN)
    all: bool = False
    dry_run: bool = False


class NamespacePurgeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    dry_run: bool = False


class PurgedNamespace(BaseModel):
    namespace: str
    pages: int
    bytes: int
    recreated: bool = Field(description="an instance is bound: the dir came back empty")


class PurgeResponse(BaseModel):
    """What a purge removed (or, with dry_run, would remove)."""

    dry_run: bool
    selector: str
    purged: list[PurgedNamespace]
    pages: int
    bytes: int
    message: str


PurgeFn = Callable[[PurgeRequest], PurgeResponse]


class GcRequest(BaseModel):
    """A GC run now: with dry_run, what it would delete (any daemon can answer that)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    dry_run: bool = False


@dataclass
class Backend:
    """What the routes need from the daemon; tests build one over a temp root."""

    layout: Layout
    reader: Reader
    registry: CollectorRegistry
    token: str | None = None
    index: IndexState | None = None
    lag: Callable[[], float] = lambda: 0.0
    purge: PurgeFn | None = None
    after_purge: Callable[[PurgeResponse], None] = lambda r: None
    gc: GcRunner | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _problem(
    status: int, title: str, detail: str | None, request: Request, **more: Any
) -> JSONResponse:
    body = Problem(title=title, status=status, detail=detail, instance=request.url.path, **more)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(
        body.model_dump(exclude_none=True), status_code=status, media_type=PROBLEM, headers=headers
    )


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": Problem, "content": {PROBLEM: {}}, "description": desc}
    for code, desc in {
        400: "bad request",
        401: "missing or wrong bearer token",
        404: "not found",
        409: "conflict",
        422: "invalid request",
        500: "internal error",
    }.items()
}


def create_app(backend: Backend) -> FastAPI:
    """The FastAPI app over `backend`."""
    app = FastAPI(
        title="cachemgr",
        version=__version__,
        description="Sidecar API of cachemgr: SGLang HiCache L3 file cache index, metrics, purge.",
        responses={422: _ERRORS[422], 500: _ERRORS[500]},
    )
    _install_errors(app)

    def auth(request: Request) -> None:
        if backend.token is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        # Bytes: compare_digest refuses non-ASCII str. Starlette decoded the header as latin-1,
        # so encoding it back gives the bytes sent; a UTF-8 token then matches its UTF-8 bytes.
        sent, expected = value.encode("latin-1"), backend.token.encode("utf-8")
        if scheme.lower() != "bearer" or not secrets.compare_digest(sent, expected):
            raise HTTPException(401, "this route needs 'Authorization: Bearer <token>'")

    def statuses() -> list[NamespaceStatus]:
        live = backend.index.counters if backend.index is not None else None
        with backend.reader() as conn:
            return namespace_statuses(conn, backend.layout, live)

    @app.get("/healthz", response_model=Health, tags=["health"])
    def healthz() -> Health:
        """Liveness: the process answers."""
        return Health(status="ok")

    @app.get(
        "/readyz",
        response_model=Readiness,
        tags=["health"],
        responses={503: {"model": Readiness, "description": "first scan not finished"}},
    )
    def readyz() -> Response:
        """Readiness: the first scan finished and the index is live."""
        ready = backend.index is not None and backend.index.ready.is_set()
        body = Readiness(ready=ready, detail="index live" if ready else "first scan running")
        return JSONResponse(body.model_dump(), status_code=200 if ready else 503)

    @app.get(
        "/metrics",
        tags=["metrics"],
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "metrics"}},
    )
    def metrics() -> Response:
        """Prometheus text exposition."""
        return Response(generate_latest(backend.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/status", response_model=Status, tags=["status"])
    def status() -> Status:
        """Every namespace with pages, bytes, reads, writes and identity, plus the index."""
        found = statuses()
        st = backend.index
        try:
            du = disk_usage(backend.layout.root)
        except OSError:
            du = None
        now = time.time()
        return Status(
            root=str(backend.layout.root),
            started_at=st.started_at if st else None,
            uptime_seconds=now - st.started_at if st else None,
            namespaces=found,
            totals=Totals(
                namespaces=len(found),
                pages=sum(s.pages for s in found),
                bytes=sum(s.bytes for s in found),
                page_reads=sum(s.page_reads for s in found),
                page_writes=sum(s.page_writes for s in found),
            ),
            index=_index_info(st, backend.lag) if st else None,
            filesystem_avail_bytes=du.avail_bytes if du else None,
            filesystem_size_bytes=du.size_bytes if du else None,
        )

    @app.get("/v1/namespaces", response_model=list[NamespaceStatus], tags=["status"])
    def namespaces() -> list[NamespaceStatus]:
        """Every namespace's status."""
        return statuses()

    @app.get(
        "/v1/namespaces/{ns_id}",
        response_model=NamespaceStatus,
        tags=["status"],
        responses={404: _ERRORS[404]},
    )
    def namespace(ns_id: NsId) -> NamespaceStatus:
        """One namespace's status."""
        for s in statuses():
            if s.id == ns_id:
                return s
        raise NotFoundError(f"no namespace {ns_id}")

    @app.get(
        "/v1/fingerprint",
        response_model=list[Fingerprint],
        tags=["status"],
        responses={404: _ERRORS[404]},
    )
    def fingerprint(
        instance: Annotated[str | None, Query(pattern=INSTANCE_PATTERN)] = None,
    ) -> list[Fingerprint]:
        """Identity records of the registered namespaces (or of one instance's namespace)."""
        return _fingerprints(backend, instance)

    purge_responses: dict[int | str, dict[str, Any]] = {k: _ERRORS[k] for k in (400, 401, 404, 409)}

    def run_purge(req: PurgeRequest) -> PurgeResponse:
        if backend.purge is None:
            raise HTTPException(501, "purge is not available in this build")
        result = backend.purge(req)
        if not req.dry_run:
            backend.after_purge(result)
        return result

    for path in PURGE_PATHS:

        @app.post(
            path,
            response_model=PurgeResponse,
            tags=["purge"],
            responses=purge_responses,
            dependencies=[Depends(auth)],
        )
        def purge(
            body: Annotated[PurgeRequest | None, Body()] = None,
            namespace: Annotated[str | None, Query(pattern=NS_ID_PATTERN)] = None,
            instance: Annotated[str | None, Query(pattern=INSTANCE_PATTERN)] = None,
            all: Annotated[bool, Query()] = False,
            dry_run: Annotated[bool, Query()] = False,
        ) -> PurgeResponse:
            """Purge namespaces (body or query: namespace, instance, all, dry_run).

            With nothing chosen it purges every namespace: `curl -X POST host:port/purge`.
            """
            req = body or PurgeRequest(
                namespace=namespace, instance=instance, all=all, dry_run=dry_run
            )
            return run_purge(req)

    @app.post(
        "/v1/namespaces/{ns_id}/purge",
        response_model=PurgeResponse,
        tags=["purge"],
        responses=purge_responses,
        dependencies=[Depends(auth)],
    )
    def purge_namespace(
        ns_id: NsId, body: Annotated[NamespacePurgeRequest | None, Body()] = None
    ) -> PurgeResponse:
        """Purge one namespace."""
        return run_purge(PurgeRequest(namespace=ns_id, dry_run=bool(body and body.dry_run)))

    @app.post(
        "/v1/gc",
        response_model=GcResponse,
        tags=["gc"],
        responses={k: _ERRORS[k] for k in (400, 401, 409)},
        dependencies=[Depends(auth)],
    )
    def gc(
        body: Annotated[GcRequest | None, Body()] = None,
        dry_run: Annotated[bool, Query()] = False,
    ) -> GcResponse:
        """Run GC now (a full run, with a sweep of the namespace dirs); 409 when another
        process leads GC on this root (the answer names it)."""
        if backend.gc is None:
            raise ConflictError("this daemon runs no GC")
        dry = dry_run or bool(body and body.dry_run)
        result = gc_request(backend.gc, dry_run=dry)
        if not result.leader:
            raise ConflictError(
                f"another process leads GC on {backend.layout.root} ({result.holder}); "
                "ask it, or use dry_run"
            )
        return result

    return app


def _index_info(st: IndexState, lag: Callable[[], float]) -> IndexInfo:
    return IndexInfo(
        ready=st.ready.is_set(),
        scans=st.scans,
        last_scan_seconds=st.last_scan_seconds,
        drift_pages=st.drift_pages,
        overflows=st.overflows,
        events_applied=st.events_applied,
        lag_seconds=lag(),
    )


def _fingerprints(backend: Backend, instance: str | None) -> list[Fingerprint]:
    with backend.reader() as conn:
        rows = conn.execute(
            "SELECT id, digest, identity_json FROM namespaces WHERE state = 'active' ORDER BY id"
        ).fetchall()
        bound: dict[str, list[str]] = {}
        for inst, ns in conn.execute("SELECT instance, namespace_id FROM bindings"):
            bound.setdefault(ns, []).append(inst)
    out = []
    for ns, digest, ident in rows:
        if instance is not None and instance not in bound.get(ns, []):
            continue
        try:
            record = json.loads(ident)
        except json.JSONDecodeError:
            record = {}
        out.append(
            Fingerprint(
                namespace=ns,
                digest=digest,
                instances=sorted(bound.get(ns, [])),
                identity=record if isinstance(record, dict) else {},
            )
        )
    if instance is not None and not out:
        raise NotFoundError(f"instance {instance!r} is not bound to a registered namespace")
    return out


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(CachemgrError)
    def cachemgr_error(request: Request, exc: CachemgrError) -> JSONResponse:
        return _problem(exc.http_status, exc.title, str(exc), request)

    @app.exception_handler(RequestValidationError)
    def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in exc.errors()
        ]
        return _problem(
            422, "invalid request", "the request does not match the API", request, errors=errors
        )

    @app.exception_handler(HTTPException)
    def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        hint = None
        if exc.status_code == 405 and request.url.path in PURGE_PATHS:
            hint = f"use POST, e.g. curl -X POST http://HOST:PORT{request.url.path}"
        title = {401: "unauthorized", 404: "not found", 405: "method not allowed"}.get(
            exc.status_code, "error"
        )
        resp = _problem(exc.status_code, title, str(exc.detail), request, hint=hint)
        if exc.headers:
            resp.headers.update(exc.headers)
        return resp


def openapi_document(app: FastAPI | None = None) -> str:
    """The app's OpenAPI document as committed in api/openapi.json."""
    from prometheus_client import CollectorRegistry

    if app is None:
        lay = Layout.at(__import__("pathlib").Path("/nonexistent"))
        app = create_app(Backend(layout=lay, reader=_no_reader, registry=CollectorRegistry()))
    return json.dumps(app.openapi(), indent=2, sort_keys=True) + "\n"


def _no_reader() -> Any:
    raise RuntimeError("no database")


if __name__ == "__main__":
    if sys.argv[1:] == ["--dump-openapi"]:
        sys.stdout.write(openapi_document())
    else:
        sys.exit("usage: python -m cachemgr.server --dump-openapi")
