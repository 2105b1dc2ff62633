"""Errors over HTTP as RFC 9457 problem details (application/problem+json)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from cachemgr.apimodels import Problem
from cachemgr.errors import CachemgrError

PROBLEM = "application/problem+json"


def _problem(
    status: int, title: str, detail: str | None, request: Request, **more: Any
) -> JSONResponse:
    """One problem+json response; a 401 says which scheme to use (RFC 9110 §11.6.1)."""
    body = Problem(title=title, status=status, detail=detail, instance=request.url.path, **more)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(
        body.model_dump(exclude_none=True), status_code=status, media_type=PROBLEM, headers=headers
    )


# The error responses routes declare in the OpenAPI document, all problem+json.
ERRORS: dict[int | str, dict[str, Any]] = {
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


def install_error_handlers(app: FastAPI, purge_paths: tuple[str, ...]) -> None:
    """Every error the app raises leaves as problem+json."""

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
        if exc.status_code == 405 and request.url.path in purge_paths:
            hint = f"use POST, e.g. curl -X POST http://HOST:PORT{request.url.path}"
        title = {401: "unauthorized", 404: "not found", 405: "method not allowed"}.get(
            exc.status_code, "error"
        )
        resp = _problem(exc.status_code, title, str(exc.detail), request, hint=hint)
        if exc.headers:
            resp.headers.update(exc.headers)
        return resp
