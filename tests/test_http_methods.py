"""A wrong method on a mutating route says which one to use: problem+json and an Allow header."""

from __future__ import annotations

import pytest
from fastapi.routing import APIRoute

from cachemgr.daemon.problems import PROBLEM
from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from tests.daemon_helpers import NS_A, RunningDaemon, register_namespace, running_daemon

UNSAFE = {"POST", "PUT", "PATCH", "DELETE"}


def _mutating_paths(dm: RunningDaemon) -> dict[str, set[str]]:
    """Every route of the running app that changes something: its path (ids filled) → methods."""
    found: dict[str, set[str]] = {}
    for route in dm.daemon.app.routes:
        if isinstance(route, APIRoute) and route.methods & UNSAFE:
            found.setdefault(route.path.replace("{ns_id}", NS_A), set()).update(route.methods)
    return found


@pytest.mark.parametrize("token", [None, "s3cret"])
def test_every_wrong_method_on_a_mutating_route_names_the_right_one(
    layout: Layout, token: str | None
) -> None:
    register_namespace(layout, NS_A, instance="gpu0")
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    with running_daemon(load_settings(root=layout.root, token=token)) as dm:
        routes = _mutating_paths(dm)
        assert {"/purge", "/v1/purge", f"/v1/namespaces/{NS_A}/purge", "/v1/gc"} <= set(routes)
        for path, allowed in routes.items():
            for method in sorted({"GET", "PUT", "PATCH", "DELETE"} - allowed):
                r = dm.http.request(method, path, headers=auth)
                what = f"{method} {path}"
                assert r.status_code == 405, (what, r.text)
                assert r.headers["content-type"] == PROBLEM, what
                assert r.headers["allow"] == ", ".join(sorted(allowed)), what
                body = r.json()
                assert body["allow"] == sorted(allowed), (what, body)
                assert body["hint"] == (
                    f"use {' or '.join(sorted(allowed))}, e.g. "
                    f"curl -X {sorted(allowed)[0]} http://HOST:PORT{path}"
                ), (what, body)
        assert dm.get("/v1/namespaces").status_code == 200  # safe routes are untouched
