"""Errors over HTTP as RFC 9457 problem details (application/problem+json)."""

from __future__ import annotations

import logging
import re
import secrets
import traceback
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cachemgr.daemon.api import Problem, RequestBody
from cachemgr.errors import CachemgrError

PROBLEM = "application/problem+json"
log = logging.getLogger(__name__)


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


# Errors that make a request ambiguous rather than mistyped: a 400 naming the parameter. A
# misspelt key (`{"namepsace": …}`), a key given twice, or a query contradicting the body
# must never read as a default.
AMBIGUOUS = frozenset({"extra_forbidden", "repeated", "duplicate_key", "contradiction"})


def invalid_request(
    errors: list[dict[str, Any]], instance: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    """The 422 for a request that does not match the API (a 400 if a parameter is unknown,
    given twice, or given in the query and the body with different values); `errors` as
    pydantic reports them."""
    found = _readable(
        [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in errors
        ]
    )
    ambiguous = [e for e in found if e["type"] in AMBIGUOUS]
    if ambiguous:
        named = ", ".join(_named(e) for e in ambiguous)
        return problem(400, "bad request", named, instance, headers, errors=found)
    detail = "the request does not match the API"
    return problem(422, "invalid request", detail, instance, headers, errors=found)


# What pydantic puts in a location for each member of a union it tried: a constrained type's
# validators (`function-after[functools.partial(<function ... at 0x7f...>, le=...)]`) and the
# request model itself (a body is `GcRequest | None`). With them came the `None` member's own
# failure ("Input should be None") beside each real one: {"max_files": 0} read as three errors,
# two of them telling the client to send null.
_UNION_MEMBER = re.compile(r"[a-z]+(-[a-z]+)*\[.*\]|constrained-[a-z]+", re.DOTALL)


def _readable(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The errors without the union members' names in their locations, and without the
    `None` member's failures when another error says what is wrong; each said once."""
    bodies = {c.__name__ for c in RequestBody.__subclasses__()}

    def member(part: object) -> bool:
        return isinstance(part, str) and (part in bodies or bool(_UNION_MEMBER.fullmatch(part)))

    cleaned = [{**e, "loc": [p for p in e["loc"] if not member(p)]} for e in found]
    real = [e for e in cleaned if e["type"] != "none_required"] or cleaned
    return [e for i, e in enumerate(real) if e not in real[:i]]


# The error responses routes declare in the OpenAPI document, all problem+json.
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": Problem, "content": {PROBLEM: {}}, "description": desc}
    for code, desc in {
        400: "bad request: a parameter unknown or given twice, the query contradicting the "
        "body, or a purge that chooses nothing",
        401: "missing or wrong bearer token",
        404: "not found",
        409: "conflict",
        413: "request body larger than the limit",
        422: "invalid request",
        500: "internal error",
        503: "the cache root cannot be written, or the state dir used, now (read-only, "
        "permissions, a foreign lock), or a path in the root is unsafe (a symlink in place of "
        ".trash/ or a namespace dir)",
    }.items()
}


TITLES = {400: "bad request", 401: "unauthorized", 404: "not found", 405: "method not allowed"}


def _named(error: dict[str, Any]) -> str:
    """One ambiguity in a 400's detail: where, and what (a contradiction names both places)."""
    if error["type"] == "contradiction":
        return str(error["msg"])
    return ".".join(str(p) for p in error["loc"]) + f": {error['msg']}"


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app raises leaves as problem+json."""

    @app.exception_handler(CachemgrError)
    def cachemgr_error(request: Request, exc: CachemgrError) -> JSONResponse:
        return problem(exc.http_status, exc.title, str(exc), request.url.path)

    @app.exception_handler(Exception)
    def internal(request: Request, exc: Exception) -> JSONResponse:
        return internal_error(exc, request.method, request.url.path)

    @app.exception_handler(RequestValidationError)
    def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return invalid_request(list(exc.errors()), request.url.path)

    @app.exception_handler(HTTPException)
    def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        title = TITLES.get(exc.status_code, "error")
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


class InternalErrors:
    """The outermost net (a pure ASGI middleware): an exception no handler answered is a
    problem+json 500 and one log line, not Starlette's text/plain 500 with a traceback in the
    log and the client's keep-alive connection dropped. A response already begun cannot be
    replaced: that one is left to the server, which closes the connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            await internal_error(exc, scope["method"], scope["path"])(scope, receive, send)


def internal_error(exc: Exception, method: str, path: str) -> JSONResponse:
    """The 500 for an exception no handler answered, and its one log line. The exception's
    text (a path, an SQL statement, a library's internals) goes to the log only: the body
    says that the daemon failed and the id its log line carries, for the operator to find."""
    error_id = secrets.token_hex(6)
    error = f"{type(exc).__name__}: {exc}"[:300]
    where = {"method": method, "route": path, "where": _where(exc), "error_id": error_id}
    log.error("http request failed", extra={**where, "error": error})
    detail = f"the daemon failed on this request; its log has the cause under error_id {error_id}"
    return problem(500, "internal error", detail, path, error_id=error_id)


def _where(exc: BaseException) -> str:
    """file:line of the frame that raised, for the log line (the traceback stays out)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "unknown"
