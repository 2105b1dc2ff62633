"""Request bodies that do not say clearly what to do are refused, before anything is done:
a purge that chooses nothing, `all: false`, a contradiction, an unknown key, a key given
twice. Against the real daemon on a loopback port, with pages on disk that must survive."""

from __future__ import annotations

from typing import Any

import pytest

from cachemgr.layout import Layout
from cachemgr.settings import Settings
from tests.daemon_helpers import (
    NS_A,
    NS_B,
    RunningDaemon,
    page_name,
    register_namespace,
    running_daemon,
    store_page,
)

PROBLEM = "application/problem+json"
JSON = {"Content-Type": "application/json"}
PURGE_ROUTES = ("/purge", "/v1/purge")

# (request, what the 400's detail must name)
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"json": {"all": False}}, "all=false"),
    ({"params": {"all": "false"}}, "all=false"),
    ({"json": {"all": False, "dry_run": True}}, "all=false"),
    ({"json": {}}, "nothing chosen"),
    ({}, "nothing chosen"),  # curl -X POST host:port/purge
    ({"json": {"dry_run": False}}, "nothing chosen"),
    ({"params": {"dry_run": "false"}}, "nothing chosen"),
    ({"json": {"all": True, "namespace": NS_A}}, "contradicts namespace"),
    ({"params": {"all": "true", "instance": "gpu0"}}, "contradicts instance"),
    ({"params": {"all": "true"}, "json": {"namespace": NS_A}}, "contradicts namespace"),
    ({"json": {"bogus": 1}}, "bogus"),
    ({"json": {"namepsace": NS_A}}, "namepsace"),
    ({"params": {"al": "true"}}, "al"),
    ({"content": b'{"dry_run": true, "dry_run": false}'}, "dry_run"),
    ({"content": b'{"all": true, "dry_run": true, "dry_run": false}'}, "dry_run"),
    ({"content": b'{"namespace": "%s", "all": false, "all": true}' % NS_A.encode()}, "all"),
]


def _on_disk(layout: Layout) -> dict[str, int]:
    return {ns: len(list(layout.ns_dir(ns).glob("*.bin"))) for ns in (NS_A, NS_B)}


@pytest.fixture
def two_namespaces(layout: Layout) -> dict[str, int]:
    for ns, instance in ((NS_A, "gpu0"), (NS_B, None)):
        d = register_namespace(layout, ns, instance=instance)
        for i in range(3):
            store_page(d, page_name(i))
    return _on_disk(layout)


def _send(dm: RunningDaemon, route: str, request: dict[str, Any]) -> Any:
    headers = JSON if "content" in request else None
    return dm.post(route, headers=headers, **request)


@pytest.mark.parametrize("route", PURGE_ROUTES)
def test_unclear_purges_are_a_400_and_purge_nothing(
    route: str, settings: Settings, layout: Layout, two_namespaces: dict[str, int]
) -> None:
    with running_daemon(settings) as dm:
        for request, named in REFUSED:
            r = _send(dm, route, request)
            assert r.status_code == 400, (request, r.text)
            assert r.headers["content-type"] == PROBLEM
            assert named in r.json()["detail"], (request, r.json())
            assert _on_disk(layout) == two_namespaces, request
        assert set(dm.namespaces()) == {NS_A, NS_B}
        # A clear request still works: all=true in the body, then in the query.
        r = dm.post(route, json={"all": True, "dry_run": True})
        assert r.status_code == 200 and r.json()["selector"] == "all"
        assert _on_disk(layout) == two_namespaces
        r = dm.post(route, params={"all": "true"})
        assert r.status_code == 200, r.text
        assert sorted(p["namespace"] for p in r.json()["purged"]) == [NS_A, NS_B]


def test_duplicate_keys_are_a_400_on_every_route_with_a_body(
    settings: Settings, layout: Layout, two_namespaces: dict[str, int]
) -> None:
    bodies = {
        "/v1/gc": b'{"dry_run": true, "dry_run": false}',
        f"/v1/namespaces/{NS_B}/purge": b'{"dry_run": true, "dry_run": false}',
        "/v1/purge": b'{"namespace": "%s", "namespace": "%s"}' % (NS_A.encode(), NS_B.encode()),
    }
    with running_daemon(settings) as dm:
        for route, body in bodies.items():
            r = dm.post(route, content=body, headers=JSON)
            assert r.status_code == 400, (route, r.text)
            assert r.headers["content-type"] == PROBLEM
            assert r.json()["errors"][0]["type"] == "duplicate_key"
        # Nested objects too: a key twice at any depth is the same ambiguity.
        r = dm.post("/v1/gc", content=b'{"x": {"a": 1, "a": 2}}', headers=JSON)
        assert r.status_code == 400
        assert _on_disk(layout) == two_namespaces


def test_the_per_namespace_route_needs_no_selector(
    settings: Settings, layout: Layout, two_namespaces: dict[str, int]
) -> None:
    with running_daemon(settings) as dm:
        r = dm.post(f"/v1/namespaces/{NS_B}/purge")
        assert r.status_code == 200, r.text
        assert [p["namespace"] for p in r.json()["purged"]] == [NS_B]
    assert _on_disk(layout) == {**two_namespaces, NS_B: 0}


@pytest.mark.parametrize("route", ["/v1/gc", "/v1/purge"])
def test_a_query_that_contradicts_the_body_is_a_400_naming_both(
    route: str, settings: Settings, layout: Layout, two_namespaces: dict[str, int]
) -> None:
    """`?dry_run=true` with `{"dry_run": false}` is a real run or not: neither is guessed."""
    body: dict[str, Any] = {"dry_run": False}
    if route == "/v1/purge":
        body["all"] = True
    with running_daemon(settings) as dm:
        r = dm.post(route, params={"dry_run": "true"}, json=body)
        assert r.status_code == 400, r.text
        assert r.headers["content-type"] == PROBLEM
        detail = r.json()["detail"]
        assert "query dry_run=true" in detail and "body dry_run=false" in detail, detail
        assert "\n" not in detail
        assert _on_disk(layout) == two_namespaces
        assert set(dm.namespaces()) == {NS_A, NS_B}
