"""HTTP purge: the routes and the function behind them (plan, then rename into .trash/).

The function runs cachemgr.ns.purge under the root lock; GC deletes .trash/ afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import anyio.to_thread
from anyio import CapacityLimiter
from fastapi import Body, FastAPI, Query, Request
from pydantic.json_schema import SkipJsonSchema
from starlette.exceptions import HTTPException

from cachemgr.daemon import mutationlog
from cachemgr.daemon.api import (
    INSTANCE_PATTERN,
    NS_ID_PATTERN,
    NamespacePurgeRequest,
    NsId,
    PurgedNamespace,
    PurgeFn,
    PurgeRequest,
    PurgeResponse,
)
from cachemgr.daemon.apiinput import one_request
from cachemgr.daemon.backend import Backend
from cachemgr.errors import BadRequestError, CachemgrError
from cachemgr.fs.locks import root_lock
from cachemgr.layout import Layout
from cachemgr.ns import bindings
from cachemgr.ns import purge as purge_mod
from cachemgr.state.store import Store

PURGE_PATHS = ("/purge", "/v1/purge")


def add_purge_routes(
    app: FastAPI, backend: Backend, purge_responses: dict[int | str, dict[str, Any]]
) -> None:
    """POST /purge, /v1/purge and /v1/namespaces/{ns_id}/purge over `backend.purge`."""
    # Purges wait here as coroutines, not as worker threads blocked on the root lock.
    purge_threads = CapacityLimiter(1)

    async def run_purge(request: Request, req: PurgeRequest) -> PurgeResponse:
        if backend.purge is None:
            raise HTTPException(501, "purge is not available in this build")
        try:
            refusal = req.selector_problem()
            if refusal is not None:
                raise BadRequestError(refusal)
            result = await anyio.to_thread.run_sync(backend.purge, req, limiter=purge_threads)
        except CachemgrError as e:
            mutationlog.failed(request, "purge", e)
            raise
        mutationlog.purged(request, result)
        if not req.dry_run:
            backend.after_purge(result)
        return result

    for path in PURGE_PATHS:

        @app.post(path, response_model=PurgeResponse, tags=["purge"], responses=purge_responses)
        async def purge(
            request: Request,
            body: Annotated[PurgeRequest | SkipJsonSchema[None], Body()] = None,
            namespace: Annotated[str | None, Query(pattern=NS_ID_PATTERN)] = None,
            instance: Annotated[str | None, Query(pattern=INSTANCE_PATTERN)] = None,
            all: Annotated[bool, Query()] = False,
            dry_run: Annotated[bool, Query()] = False,
        ) -> PurgeResponse:
            """Purge namespaces (body or query: namespace, instance, all, dry_run).

            Every namespace only with `all=true`: `curl -X POST 'host:port/purge?all=true'`.
            Nothing chosen, `all=false`, or `all` with a namespace or instance is a 400.
            A parameter may be given in the query, the body, or both with the same value.
            """
            query = dict(namespace=namespace, instance=instance, all=all, dry_run=dry_run)
            return await run_purge(request, await one_request(request, PurgeRequest, body, **query))

    @app.post(
        "/v1/namespaces/{ns_id}/purge",
        response_model=PurgeResponse,
        tags=["purge"],
        responses=purge_responses,
    )
    async def purge_namespace(
        request: Request,
        ns_id: NsId,
        body: Annotated[NamespacePurgeRequest | SkipJsonSchema[None], Body()] = None,
    ) -> PurgeResponse:
        """Purge one namespace."""
        req = await one_request(request, NamespacePurgeRequest, body)
        return await run_purge(request, PurgeRequest(namespace=ns_id, dry_run=req.dry_run))


def purge_function(layout: Layout, after: Callable[[], None]) -> PurgeFn:
    """Purge through cachemgr.ns.purge: rename now; `after` (wake GC) deletes .trash/ later."""

    def run(req: PurgeRequest) -> PurgeResponse:
        with Store.open(layout.db_path) as store:
            selector, targets, problems = (_would_purge if req.dry_run else _purge_now)(
                layout, store, req
            )
        if not req.dry_run:
            after()
        verb = "would purge" if req.dry_run else "purged"
        pages, size = sum(t.pages for t in targets), sum(t.bytes for t in targets)
        return PurgeResponse(
            dry_run=req.dry_run,
            selector=selector,
            purged=targets,
            pages=pages,
            bytes=size,
            message=f"{verb} {len(targets)} namespace(s): {pages} pages, {size} bytes",
            problems=problems,
        )

    return run


# A plan's selector, what it (would) purge, and what it left alone (damaged namespaces).
Targets = tuple[str, list[PurgedNamespace], list[str]]


def _would_purge(layout: Layout, store: Store, req: PurgeRequest) -> Targets:
    plan = _plan(layout, store, req)
    return (
        plan.selector,
        [
            PurgedNamespace(namespace=t.ns_id, pages=t.pages, bytes=t.bytes, recreated=t.kept)
            for t in plan.targets
        ],
        list(plan.problems),
    )


def _purge_now(layout: Layout, store: Store, req: PurgeRequest) -> Targets:
    """Plan and purge under one hold of the root lock: a purge racing this one (CLI, HTTP) is
    wholly before or after it, and the later one finds nothing left to do."""
    with root_lock(layout):
        plan = _plan(layout, store, req)
        result = purge_mod.execute_purge(plan, layout, store, actor="http", reason="manual")
    return (
        plan.selector,
        [
            PurgedNamespace(namespace=p.ns_id, pages=p.pages, bytes=p.bytes, recreated=p.recreated)
            for p in result.purged
        ],
        list(plan.problems),
    )


def _plan(layout: Layout, store: Store, req: PurgeRequest) -> purge_mod.PurgePlan:
    """One plan for the union of the request's selectors (all=true: everything)."""
    if layout.node is not None:  # which namespaces the other nodes' servers use, as of now
        bindings.catch_up(layout, store)
    if req.all:
        return purge_mod.plan_purge(layout, store, all=True)
    refusal = req.selector_problem()
    if refusal is not None:  # the route refuses it first; a plan never guesses "everything"
        raise BadRequestError(refusal)
    plans = []
    if req.namespace:
        plans.append(purge_mod.plan_purge(layout, store, namespace=req.namespace))
    if req.instance:
        plans.append(purge_mod.plan_purge(layout, store, instance=req.instance))
    targets = {t.ns_id: t for p in plans for t in p.targets}
    return purge_mod.PurgePlan(
        tuple(targets[ns] for ns in sorted(targets)),
        plans[0].trash,
        " + ".join(p.selector for p in plans),
        problems=tuple(sorted({x for p in plans for x in p.problems})),
    )
