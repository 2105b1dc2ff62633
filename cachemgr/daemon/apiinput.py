"""How the mutating routes read a request: the body and the query together, strictly.

A destructive default (a real purge or GC) must never be reached by a malformed request, so
what FastAPI would quietly resolve is refused here: a body of `null` (FastAPI reads it as no
body at all; a 422), a query parameter the route does not take (`?dryrun=true` would be a real
run; a 400), and a field given in both the query and the body with different values (a 400
naming both). A field given in both with the same value is fine. (Repeated query parameters
are refused earlier, by httpguard.)
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError

from cachemgr.daemon.api import RequestBody

M = TypeVar("M", bound=RequestBody)


async def one_request(request: Request, model: type[M], body: M | None, **query: Any) -> M:
    """The request `body` and the route's `query` parameters make together, or a 400/422."""
    errors: list[dict[str, Any]] = []
    if body is None and await request.body():
        errors.append(_error(("body",), "must be a JSON object, or no body at all", "model_type"))
    for name in sorted(request.query_params.keys() - query.keys()):
        errors.append(_error(("query", name), "not a parameter of this route", "extra_forbidden"))
    given = {k: v for k, v in query.items() if k in request.query_params}
    in_body = body.model_dump(include=body.model_fields_set) if body is not None else {}
    for name in sorted(given.keys() & in_body.keys()):
        if given[name] != in_body[name]:
            msg = (
                f"query {name}={json.dumps(given[name])} contradicts body "
                f"{name}={json.dumps(in_body[name])}: give it once"
            )
            errors.append(_error(("query", name), msg, "contradiction"))
    if errors:
        raise RequestValidationError(errors)
    return model(**{**given, **in_body})


def _error(loc: tuple[str, ...], msg: str, kind: str) -> dict[str, Any]:
    return {"loc": loc, "msg": msg, "type": kind}
