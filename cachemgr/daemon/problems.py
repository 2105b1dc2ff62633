"""Errors over HTTP as RFC 9457 problem details (application/problem+json)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from cachemgr.daemon.api import Problem
from cachemgr.errors import CachemgrError

PROBLEM = "application/problem+json"


def problem(
    status: int,
    title: str,
    detail: str | None,
    instance: str,
    headers: dict[str, str] | None = None,
    **more: Any,
) -> JSONResponse:
    """One problem+json response; a 401 says which scheme to use (RFC 9110 §11.6.1)."""
    body = Problem(title=title, status=status, detail=detail, instance=instance, **more)
    if status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return JSONResponse(
        body.model_dump(exclude_none=True), status_code=status, media_type=PROBLEM, headers=headers
    )


def invalid_request(
    errors: list[dict[str, Any]], instance: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    """The 422 for a request that does not match the API; `errors` as pydantic reports them."""
    found = [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
        for e in errors
    ]
    detail = "the request does not match the API"
    return problem(422, "invalid request", detail, instance, headers, errors=found)


# The error responses routes declare in the OpenAPI document, all problem+json.
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": Problem, "content": {PROBLEM: {}}, "description": desc}
    for code, desc in {
        400: "bad request",
        401: "missing or wrong bearer token",
        404: "not found",
        409: "conflict",
        413: "request body larger than the limit",
        422: "invalid request",
        500: "internal error",
        503: "the cache root cannot be written now (read-only, permissions)",
    }.items()
}


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app raises leaves as problem+json."""

    @app.exception_handler(CachemgrError)
    def cachemgr_error(request: Request, exc: CachemgrError) -> JSONResponse:
        return problem(exc.http_status, exc.title, str(exc), request.url.path)

    @app.exception_handler(Exception)
    def internal(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback after this; the client gets problem+json, not text.
        return problem(500, "internal error", f"{type(exc).__name__}: {exc}", request.url.path)

    @app.exception_handler(RequestValidationError)
    def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return invalid_request(list(exc.errors()), request.url.path)

    @app.exception_handler(HTTPException)
    def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        title = {401: "unauthorized", 404: "not found", 405: "method not allowed"}.get(
            exc.status_code, "error"
        )
        path = request.url.path
        more = _method_hint(path, exc.headers) if exc.status_code == 405 else {}
        resp = problem(exc.status_code, title, str(exc.detail), path, **more)
        if exc.headers:
            resp.headers.update(exc.headers)
        return resp


def _method_hint(path: str, headers: Mapping[str, str] | None) -> dict[str, Any]:
    """The methods the route takes (Starlette's Allow header) and how to call it with one:
    `curl host:port/v1/gc` is a GET, and GC, like every change, takes a POST."""
    allow = sorted(m.strip() for m in (headers or {}).get("Allow", "").split(",") if m.strip())
    if not allow:
        return {}
    hint = f"use {' or '.join(allow)}, e.g. curl -X {allow[0]} http://HOST:PORT{path}"
    return {"allow": allow, "hint": hint}
