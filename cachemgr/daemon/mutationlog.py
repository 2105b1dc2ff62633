"""One structured log line per mutating HTTP call: who asked (the client address), which
route, and what was done, or why nothing was. uvicorn's access log is off; this is the trail
an operator reads after "who purged the cache?"."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.types import Scope

from cachemgr.daemon.api import PurgeResponse
from cachemgr.daemon.gcapi import GcResponse
from cachemgr.errors import CachemgrError
from cachemgr.logs import HTTP_TRAIL

log = HTTP_TRAIL


def client_of(scope: Scope) -> str:
    """`host:port` of the peer, as the server saw it."""
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "unknown"


def _who(request: Request) -> dict[str, Any]:
    return {"client": client_of(request.scope), "route": request.url.path}


def purged(request: Request, result: PurgeResponse) -> None:
    """A purge (or its dry run) that was answered 200."""
    log.info(
        "http purge",
        extra={
            **_who(request),
            "dry_run": result.dry_run,
            "selector": result.selector,
            "namespaces": [p.namespace for p in result.purged],
            "pages": result.pages,
            "bytes": result.bytes,
            "problems": result.problems,
        },
    )


def collected(request: Request, result: GcResponse) -> None:
    """A GC run (or its dry run) that was answered 200."""
    log.info(
        "http gc",
        extra={
            **_who(request),
            "dry_run": result.dry_run,
            "files": result.files,
            "bytes": result.bytes,
            "warnings": result.warnings,
        },
    )


def failed(request: Request, what: str, error: CachemgrError) -> None:
    """A mutating call a route refused (not found, conflict, …): nothing was done."""
    log.warning(
        f"http {what} refused",
        extra={**_who(request), "status": error.http_status, "error": str(error)},
    )


def refused(scope: Scope, status: int) -> None:
    """A mutating call the front door refused (no token, too large) before any route."""
    log.warning(
        "http request refused",
        extra={
            "client": client_of(scope),
            "route": scope["path"],
            "method": scope["method"],
            "status": status,
        },
    )
