"""The HTTP API (FastAPI): health, metrics, status, purge and GC; errors as problem+json.

`python -m cachemgr.daemon.app --dump-openapi` prints the OpenAPI document that is committed as
api/openapi.json (a test fails when they differ).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path as FsPath
from typing import Annotated, Any

import anyio
from fastapi import Body, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError
from pydantic.json_schema import SkipJsonSchema

from cachemgr import __version__
from cachemgr.daemon import mutationlog
from cachemgr.daemon.api import (
    INSTANCE_PATTERN,
    Fingerprint,
    GcRequest,
    GcUnmet,
    Health,
    IndexInfo,
    NsId,
    Readiness,
    Status,
    Totals,
)
from cachemgr.daemon.apiinput import one_request
from cachemgr.daemon.backend import Backend
from cachemgr.daemon.fleet import SUMMARY_MAX_BYTES, add_fleet_routes
from cachemgr.daemon.gcapi import GcResponse, SharedGcRuns, gc_limits
from cachemgr.daemon.httpguard import MAX_BODY_BYTES, RequestGuard
from cachemgr.daemon.index_state import IndexState
from cachemgr.daemon.problems import ERRORS, InternalErrors, install_error_handlers
from cachemgr.daemon.purge_routes import add_purge_routes
from cachemgr.errors import CachemgrError, ConflictError, IndexSettling, NotFoundError
from cachemgr.fleet.accesses import SUMMARY_PATH
from cachemgr.fs.usage import disk_usage
from cachemgr.gc.policy import GcPolicy
from cachemgr.layout import Layout
from cachemgr.ns.purge_intent import trash_counts
from cachemgr.ns.quarantine import STATE_DIR
from cachemgr.ns.status import NamespaceStatus, namespace_statuses
from cachemgr.ns.trash import left_for_people
from cachemgr.settings import one_off
from cachemgr.state import busy, registry_sql
from cachemgr.state.dbfile import unavailable
from cachemgr.state.status import bindings_by_namespace

# Seconds POST /v1/gc waits for GC to be able to run before its 503 (the index settles).
SETTLE_WAIT = 30.0


def create_app(backend: Backend) -> FastAPI:
    """The FastAPI app over `backend`; /docs loads Swagger UI from the daemon itself, not a
    CDN (a GPU host is often air-gapped)."""
    app = FastAPIOffline(
        # No ReDoc: its page fetches a logo from its vendor's CDN whatever it is given.
        redoc_url=None,
        title="cachemgr",
        version=__version__,
        description=(
            "Sidecar API of cachemgr, for the on-disk KV cache tier of SGLang (HiCache L3 file "
            "backend) and vLLM (fs tier): page index, metrics, GC, purge. "
            "POST routes need `Authorization: Bearer <token>` when the daemon has one (401 "
            f"before anything else); a request body is a JSON object of at most {MAX_BODY_BYTES}"
            " bytes (413); a query parameter is given once."
        ),
        responses={400: ERRORS[400], 422: ERRORS[422], 500: ERRORS[500]},
    )
    install_error_handlers(app)
    app.add_middleware(RequestGuard, token=backend.token, large={SUMMARY_PATH: SUMMARY_MAX_BYTES})
    app.add_middleware(InternalErrors)  # added last: outermost, around the guard too

    def statuses() -> list[NamespaceStatus]:
        live = backend.index.counters if backend.index is not None else None
        with backend.reader() as conn:
            return namespace_statuses(conn, backend.layout, live)

    def recorded_trash() -> dict[str, tuple[int, int]]:
        with backend.reader() as conn:
            return trash_counts(backend.layout, conn)

    @app.get("/healthz", response_model=Health, tags=["health"])
    def healthz() -> Health:
        """Liveness: the process answers."""
        return Health(status="ok")

    @app.get(
        "/readyz",
        response_model=Readiness,
        tags=["health"],
        responses={
            503: {
                "model": Readiness,
                "description": "first scan not finished, a worker died, or the state dir "
                "cannot be used (its mode, or its filesystem full)",
            }
        },
    )
    def readyz() -> Response:
        """Readiness: the first scan finished, the index is live and no worker thread died."""
        body = _readiness(backend)
        return JSONResponse(body.model_dump(), status_code=200 if body.ready else 503)

    @app.get(
        "/metrics",
        tags=["metrics"],
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "metrics"}},
    )
    async def metrics() -> Response:
        """Prometheus text exposition."""
        # On the event loop, not a worker thread: in the daemon it renders a snapshot held in
        # memory (cachemgr.daemon.refresher), so nothing here blocks.
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
        return Status(
            root=str(backend.layout.root),
            started_at=st.started_at if st else None,
            uptime_seconds=st.uptime() if st else None,
            namespaces=found,
            totals=Totals(
                namespaces=len(found),
                pages=sum(s.pages for s in found if s.pages is not None),
                bytes=sum(s.bytes for s in found if s.bytes is not None),
                page_reads=sum(s.page_reads for s in found),
                page_writes=sum(s.page_writes for s in found),
            ),
            index=_index_info(st, backend.lag) if st else None,
            filesystem_avail_bytes=du.free if du else None,
            filesystem_size_bytes=du.total if du else None,
            gc_limits=gc_limits(backend.gc.policy) if backend.gc is not None else None,
            gc_unmet=[GcUnmet.of(u) for u in backend.gc.stats.unmet] if backend.gc else [],
            gc_model_keys_in_memory=backend.gc.live.keys_in_memory() if backend.gc else 0,
            left_for_a_person=left_for_people(backend.layout, recorded_trash()),
        )

    @app.get("/v1/namespaces", response_model=list[NamespaceStatus], tags=["status"])
    def namespaces() -> list[NamespaceStatus]:
        """Every namespace's status."""
        return statuses()

    @app.get(
        "/v1/namespaces/{ns_id}",
        response_model=NamespaceStatus,
        tags=["status"],
        responses={404: ERRORS[404]},
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
        responses={404: ERRORS[404]},
    )
    def fingerprint(
        instance: Annotated[str | None, Query(pattern=INSTANCE_PATTERN)] = None,
    ) -> list[Fingerprint]:
        """Identity records of the registered namespaces (or of one instance's namespace)."""
        return _fingerprints(backend, instance)

    mutating: dict[int | str, dict[str, Any]] = {k: ERRORS[k] for k in (400, 401, 409, 413)}
    add_purge_routes(app, backend, {**mutating, 404: ERRORS[404], 503: ERRORS[503]})
    add_fleet_routes(app, backend.fleet)
    gc_runs = SharedGcRuns(backend.gc) if backend.gc is not None else None

    @app.post(
        "/v1/gc",
        response_model=GcResponse,
        tags=["gc"],
        responses={**mutating, 503: ERRORS[503]},
    )
    async def gc(
        request: Request,
        body: Annotated[GcRequest | SkipJsonSchema[None], Body()] = None,
        dry_run: Annotated[bool, Query()] = False,
    ) -> GcResponse:
        """Run GC now (a full run, with a sweep of the namespace dirs); 409 when another
        process leads GC on this root (the answer names it). One-off limits in the body
        (`{"max_bytes": "10MB"}`) hold for this run only. A request made while a run of the
        same kind (dry or not, the same limits) is in progress gets that run's result.

        503 "state database locked" when another process holds the state DB's write lock
        longer than a write waits (10 s) while the run records files it deleted: the run
        deletes no more, and the answer comes then, naming the holder. The files deleted
        are recorded (index rows dropped, an `evict` audit row) once the lock is released,
        by the run itself, which waits for it however long it takes: nothing deleted goes
        unrecorded. Ask again after."""
        req = await one_request(request, GcRequest, body, dry_run=dry_run)
        try:
            result = await _gc(req.dry_run, _one_off_policy(backend, req))
        except CachemgrError as e:
            mutationlog.failed(request, "gc", e)
            raise
        mutationlog.collected(request, result)
        return result

    async def _gc(dry_run: bool, policy: GcPolicy | None) -> GcResponse:
        if gc_runs is None:
            raise ConflictError("this daemon runs no GC")
        if backend.index is not None and not await _settled(backend.index, SETTLE_WAIT):
            raise IndexSettling(backend.index.gc_waits())
        result = await gc_runs.run(dry_run=dry_run, policy=policy)
        if not result.leader and not dry_run:
            raise ConflictError(
                f"another process leads GC on {backend.layout.root} ({result.holder}); "
                "ask it, or use dry_run"
            )
        return result

    return app


async def _settled(index: IndexState, wait: float) -> bool:
    """Whether GC may run, waiting up to `wait` seconds for it: a first start loads GC's model
    after it is ready (a batch interval for a small root), and a script that waited for
    /readyz should not get a 503 for that."""
    deadline = time.monotonic() + wait
    while not index.settled.is_set():
        if time.monotonic() >= deadline:
            return False
        await anyio.sleep(0.05)
    return True


def _one_off_policy(backend: Backend, req: GcRequest) -> GcPolicy | None:
    """The policy of a run with the request's one-off limits, checked as the settings check a
    `cachemgr gc` flag (a 422 naming the field); None without any."""
    limits = req.limits()
    if not limits:
        return None
    if backend.settings is None or backend.gc is None:
        raise ConflictError("this daemon runs no GC")
    try:
        settings = one_off(backend.settings, limits)
    except ValidationError as e:
        errors = [
            {**err, "loc": ("body", *(str(p).removeprefix("gc_") for p in err["loc"]))}
            for err in e.errors(include_url=False, include_context=False)
        ]
        raise RequestValidationError(errors) from None
    # The root's filesystem, and so its flat-dir entry limit, is the one the daemon read at
    # start: a request does not read the mount table and the superblock again.
    served = backend.gc.policy.dir_entries
    return GcPolicy.from_settings(settings, dir_index=lambda _root: served)


def _readiness(backend: Backend) -> Readiness:
    dead = [f"{w.name} worker died: {w.error}" for w in backend.workers if not w.up]
    if dead:
        return Readiness(ready=False, detail="; ".join(dead))
    ready = backend.index is not None and backend.index.ready.is_set()
    detail = "index live" if ready else "first scan running"
    if ready and backend.index is not None and backend.index.settling:
        detail = f"index live; {backend.index.gc_waits()}"
    # Nothing can be indexed, collected or purged until the state dir's mode is fixed, or
    # while its filesystem is full (the quarantine's detail says whose space that is).
    state = unavailable(backend.layout.state_dir, backend.layout.db_path)
    quarantine = backend.quarantine
    full = quarantine is not None and quarantine.holds(STATE_DIR, "full")
    # Degraded, still ready: writes wait and catch up, the other namespaces are served (a
    # 503 would take SGLang's pod out of service).
    unusable = quarantine.degraded() if quarantine is not None else None
    said = [detail, *filter(None, [state, busy.LOCKS.degraded(), unusable])]
    ok = ready and state is None and not full
    return Readiness(ready=ok, detail="; ".join(map(str, said)))


def _index_info(st: IndexState, lag: Callable[[], float]) -> IndexInfo:
    return IndexInfo(
        ready=st.ready.is_set(),
        settled=st.settled.is_set(),
        leader=st.leader,
        scans=st.scans,
        last_scan_seconds=st.last_scan_seconds,
        drift_pages=st.drift_pages,
        overflows=st.overflows,
        events_applied=st.events_applied,
        lag_seconds=lag(),
        watches_refused=st.watch_gaps.refused,
        watch_refused_at=st.watch_gaps.refused_at,
        watch_refused_namespaces=st.watch_gaps.short,
        watch_root_refused=st.watch_gaps.root,
    )


def _fingerprints(backend: Backend, instance: str | None) -> list[Fingerprint]:
    with backend.reader() as conn:
        rows = registry_sql.active_namespaces(conn)
        bound = bindings_by_namespace(conn)
    out = []
    for ns, digest, ident in rows:
        if instance is not None and instance not in bound.get(ns, ()):
            continue
        try:
            record = json.loads(ident)
        except json.JSONDecodeError:
            record = {}
        out.append(
            Fingerprint(
                namespace=ns,
                digest=digest,
                instances=list(bound.get(ns, ())),
                identity=record if isinstance(record, dict) else {},
            )
        )
    if instance is not None and not out:
        raise NotFoundError(f"instance {instance!r} is not bound to a registered namespace")
    return out


def openapi_document(app: FastAPI | None = None) -> str:
    """The app's OpenAPI document as committed in api/openapi.json."""
    if app is None:
        lay = Layout.at(FsPath("/nonexistent"))
        app = create_app(Backend(layout=lay, reader=_no_reader, registry=CollectorRegistry()))
    return json.dumps(app.openapi(), indent=2, sort_keys=True) + "\n"


def _no_reader() -> Any:
    raise RuntimeError("no database")


if __name__ == "__main__":
    if sys.argv[1:] == ["--dump-openapi"]:
        sys.stdout.write(openapi_document())
    else:
        sys.exit("usage: python -m cachemgr.daemon.app --dump-openapi")
