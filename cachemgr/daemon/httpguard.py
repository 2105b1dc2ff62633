"""The API's front door, a pure ASGI middleware: authenticate, refuse ambiguous query strings,
read at most MAX_BODY_BYTES of a body and refuse a JSON body with a key given twice, all
before any route sees the request.

FastAPI reads a whole body before it solves a route's dependencies (auth included): a 1 GiB
body without a token cost 2 GiB of RSS and was answered 422. Here the headers decide first,
and a body is counted as it arrives (declared or chunked) and never held past the cap.
A refusal that leaves body bytes unread closes the connection, so uvicorn does not read and
discard the rest of them.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cachemgr.daemon import mutationlog
from cachemgr.daemon.problems import invalid_request, problem

# The largest valid body (a purge by instance) is under 300 bytes; this leaves room for
# pretty-printed JSON and nothing else.
MAX_BODY_BYTES = 4096
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})  # RFC 9110 §9.2.1: they change nothing
CLOSE = {"Connection": "close"}


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


class RequestGuard:
    """Every unsafe method needs the bearer token (when one is set); no query parameter may be
    given twice; a body over `max_body` bytes is a 413; no JSON key may be given twice in one
    object (json.loads would keep the last: `{"dry_run": true, "dry_run": false}` was a real
    purge). Checked in that order."""

    def __init__(
        self,
        app: ASGIApp,
        token: str | None,
        max_body: int = MAX_BODY_BYTES,
        large: Mapping[str, int] | None = None,
    ) -> None:
        self.app = app
        self.token = token.encode("utf-8") if token is not None else None
        self.default_max_body = max_body
        self.large = dict(large or {})  # paths whose bodies may be larger (fleet summaries)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refuse_headers(scope)
        if refusal is None:
            try:
                body = await self._read_body(receive, self._cap(scope["path"]))
            except _TooLarge:
                refusal = self._too_large(scope["path"])
            except _Disconnected:
                return  # nobody to answer
            else:
                refusal = _duplicate_keys(body, scope["path"])
                receive = _replay(body, receive)
        if refusal is not None:
            if scope["method"] not in SAFE_METHODS:
                mutationlog.refused(scope, refusal.status_code)
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refuse_headers(self, scope: Scope) -> Response | None:
        """The answer the headers alone earn (401, 422, 413), or None."""
        headers = dict(reversed(scope["headers"]))  # the first of a repeated header, as Starlette
        path = scope["path"]
        close = CLOSE if _has_body(headers) else None
        if scope["method"] not in SAFE_METHODS and not self._authorized(headers):
            detail = "this route needs 'Authorization: Bearer <token>'"
            return problem(401, "unauthorized", detail, path, close)
        repeated = _repeated(scope.get("query_string", b"").decode("latin-1"))
        if repeated:
            errors = [
                {"loc": ("query", name), "msg": "given more than once", "type": "repeated"}
                for name in repeated
            ]
            return invalid_request(errors, path, close)
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self._cap(path):
            return self._too_large(path)
        return None

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        if self.token is None:
            return True
        scheme, _, sent = headers.get(b"authorization", b"").partition(b" ")
        # Bytes on both sides: compare_digest refuses non-ASCII str, and a UTF-8 token then
        # matches the UTF-8 bytes a client sends.
        return scheme.lower() == b"bearer" and secrets.compare_digest(sent, self.token)

    def _cap(self, path: str) -> int:
        return self.large.get(path, self.default_max_body)

    def _too_large(self, path: str) -> Response:
        detail = f"request bodies are limited to {self._cap(path)} bytes"
        return problem(413, "content too large", detail, path, CLOSE)

    async def _read_body(self, receive: Receive, cap: int) -> bytes:
        """Read the whole body, at most `cap` bytes."""
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                raise _TooLarge
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)


def _has_body(headers: dict[bytes, bytes]) -> bool:
    return headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers


def _repeated(query: str) -> list[str]:
    """Names given more than once: FastAPI would quietly take the last value of a scalar."""
    seen: set[str] = set()
    repeated: list[str] = []
    for name, _ in parse_qsl(query, keep_blank_values=True):
        if name in seen and name not in repeated:
            repeated.append(name)
        seen.add(name)
    return repeated


def _duplicate_keys(body: bytes, path: str) -> Response | None:
    """The 400 for a JSON body that gives a key twice in one object, or None (a body that is
    not JSON is left to the route, which answers 422)."""
    repeated: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in items]
        repeated.extend(k for i, k in enumerate(keys) if k in keys[:i] and k not in repeated)
        return dict(items)

    if not body.strip():
        return None
    try:
        json.loads(body, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return None
    if not repeated:
        return None
    errors = [
        {"loc": ("body", name), "msg": "given more than once", "type": "duplicate_key"}
        for name in repeated
    ]
    return invalid_request(errors, path)


def _replay(body: bytes, receive: Receive) -> Callable[[], Awaitable[Message]]:
    """A receive that gives the body read already, then whatever the server sends next."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay
