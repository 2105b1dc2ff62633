"""Fuzz the HTTP API from its committed OpenAPI document (schemathesis) against the running
daemon: no 5xx, and no response outside the documented schema, content type or status."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError
from schemathesis import Case
from schemathesis.specs.openapi.checks import positive_data_acceptance

from cachemgr.daemon.api import PurgeRequest
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from tests.daemon_helpers import (
    NS_A,
    NS_B,
    RunningDaemon,
    page_name,
    register_namespace,
    running_daemon,
    store_page,
)

REPO = Path(__file__).resolve().parent.parent
schema = schemathesis.openapi.from_path(REPO / "api" / "openapi.json")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    root = Path(tmp_path_factory.mktemp("fuzz")) / "root"
    layout = Layout.at(root)
    create_root(layout)
    d = register_namespace(layout, NS_A, instance="gpu0")
    store_page(d, page_name(0))
    with running_daemon(load_settings(root=root)) as dm:
        yield dm


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_openapi_document(case: Case, daemon: RunningDaemon) -> None:
    unclear = (
        _query_contradicts_body(case) or _chooses_nothing_clearly(case) or _gc_limit_given(case)
    )
    skip = [positive_data_acceptance] if unclear else []
    case.call_and_validate(base_url=daemon.url, excluded_checks=skip)


def _query_contradicts_body(case: Case) -> bool:
    """A field the query and the body both give, with different values: a 400 by design (a
    real purge or GC is never a guess), which OpenAPI cannot state across parameters and body."""
    body = case.body if isinstance(case.body, dict) else {}
    return any(
        name in body and _text(body[name]) != _text(value)
        for name, value in (case.query or {}).items()
    )


def _chooses_nothing_clearly(case: Case) -> bool:
    """A purge whose selectors are missing, false or contradictory: a 400 by design (see the
    route's description), which the schema cannot state across the query and the body."""
    if case.path not in ("/purge", "/v1/purge"):
        return False
    body = case.body if isinstance(case.body, dict) else {}
    try:
        req = PurgeRequest.model_validate({**(case.query or {}), **body}, strict=False)
    except ValidationError:
        return False  # a 422 the other checks judge
    return req.selector_problem() is not None


def _gc_limit_given(case: Case) -> bool:
    """A one-off GC limit: the settings model checks it as it checks the CLI's flag (a 422
    naming it), and the schema cannot say all of that (a string that is no size or duration,
    a duration longer than the settings allow)."""
    body = case.body if isinstance(case.body, dict) else {}
    return case.path == "/v1/gc" and bool(body.keys() - {"dry_run"})


def _text(value: object) -> str:
    """A value as the query string carries it."""
    return json.dumps(value) if isinstance(value, bool) else str(value)


# --- purges: no request purges more than its selector names --------------------------------

NS_C = "00000000c0ffee00"
BOUND = {NS_A: "gpu0", NS_B: "gpu1", NS_C: None}
PAGES = 2
SELECTORS = ("namespace", "instance", "all")
# Values a selector takes: the namespaces and instances that exist, ones that do not, and both
# booleans (a false selector, and `all: true` beside another one, are what purged everything).
VALUES = {
    "namespace": st.sampled_from([NS_A, NS_B, NS_C, "0" * 16]),
    "instance": st.sampled_from(["gpu0", "gpu1", "nobody"]),
    "all": st.booleans(),
    "dry_run": st.booleans(),
}
KEYS = st.sampled_from([*VALUES, "bogus", "namepsace"])


@st.composite
def purge_requests(draw: st.DrawFn) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """Key/value pairs for the body and for the query; a key may repeat (a duplicate JSON key),
    a query key never does (httpguard refuses it, tested elsewhere)."""
    pair = KEYS.flatmap(lambda k: st.tuples(st.just(k), VALUES.get(k, st.integers(0, 1))))
    body = draw(st.lists(pair, max_size=4))
    query = draw(st.lists(pair, max_size=2, unique_by=lambda kv: kv[0]))
    return body, query


def _named(pairs: list[tuple[str, Any]]) -> set[str] | None:
    """The most a request may purge: the namespaces its selectors name (the instances' too);
    None (every namespace) only if `all` is given, only as true, and nothing else is chosen."""
    alls = [v for k, v in pairs if k == "all"]
    chosen = [(k, v) for k, v in pairs if k in ("namespace", "instance")]
    if alls and all(v is True for v in alls) and not chosen:
        return None
    by_instance = {inst: ns for ns, inst in BOUND.items() if inst}
    named = {str(v) for k, v in chosen if k == "namespace"}
    return named | {by_instance.get(str(v), "") for k, v in chosen if k == "instance"}


def _as_query_reads(name: str, value: Any) -> Any:
    """A query value as the route reads it: "true", "1", "yes" or "on" is a true boolean."""
    if name not in ("all", "dry_run") or isinstance(value, bool):
        return value
    try:
        return TypeAdapter(bool).validate_python(value)
    except ValidationError:
        return value  # a 422


def _pages(layout: Layout) -> dict[str, int]:
    return {ns: len(list(layout.ns_dir(ns).glob("*.bin"))) for ns in BOUND}


def _restock(layout: Layout) -> None:
    """Every namespace registered, bound and holding PAGES pages again."""
    for ns, inst in BOUND.items():
        if len(list(layout.ns_dir(ns).glob("*.bin"))) < PAGES:
            d = register_namespace(layout, ns, instance=inst)
            for i in range(PAGES):
                store_page(d, page_name(i))


@pytest.fixture(scope="module")
def purge_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    root = Path(tmp_path_factory.mktemp("fuzz-purge")) / "root"
    create_root(Layout.at(root))
    _restock(Layout.at(root))
    with running_daemon(load_settings(root=root, gc_interval=3600)) as dm:
        yield dm


Pairs = list[tuple[str, Any]]


@pytest.mark.parametrize("route", ["/purge", "/v1/purge"])
@given(request=purge_requests())
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_purge_removes_more_than_its_selector_names(
    route: str, request: tuple[Pairs, Pairs], purge_daemon: RunningDaemon
) -> None:
    body, query = request
    _purge_within_its_selectors(purge_daemon, route, body, query)


purges = schema.include(path_regex="purge$")


@purges.parametrize()
@purges.given(data=st.data())
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_schema_purges_with_a_key_twice_or_all_false_purge_nothing(
    case: Case, data: st.DataObject, purge_daemon: RunningDaemon
) -> None:
    """Schemathesis's valid purges, as generated, then with a key given twice (the last value
    flipped: what json.loads would keep) or with `"all": false` added."""
    body: Pairs = list(case.body.items()) if isinstance(case.body, dict) else []
    query: Pairs = list((case.query or {}).items())
    twist = data.draw(st.sampled_from(["as generated", "a key twice", "all false"]))
    if twist == "a key twice" and body:
        key, value = data.draw(st.sampled_from(body))
        body.append((key, not value if isinstance(value, bool) else value))
    elif twist == "all false":
        body.append(("all", False))
    else:
        twist = "as generated"
    path = case.formatted_path
    own = {case.path_parameters["ns_id"]} if case.path_parameters else set()
    status = _purge_within_its_selectors(purge_daemon, path, body, query, also=own)
    if twist != "as generated":
        assert status in (400, 422), (twist, body, query)


def _purge_within_its_selectors(
    dm: RunningDaemon, route: str, body: Pairs, query: Pairs, also: set[str] = frozenset()
) -> int:
    """Send the request (the body as raw JSON, so a key may repeat) to a root holding every
    namespace, and check that it purged at most what it names; its status."""
    layout = dm.daemon.layout
    _restock(layout)
    before = _pages(layout)
    raw = "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in body) + "}"
    r = dm.post(
        route,
        content=raw.encode() if body else None,
        headers={"Content-Type": "application/json"} if body else None,
        params=[(k, _text(v)) for k, v in query],
    )
    assert r.status_code < 500, r.text
    after = _pages(layout)
    purged = {ns for ns in BOUND if after[ns] < before[ns]}
    named = _named(body + [(k, _as_query_reads(k, v)) for k, v in query])
    if named is not None:
        assert purged <= named | also, (route, body, query, r.text)
    keys = [k for k, _ in body]
    if len(keys) != len(set(keys)):
        assert r.status_code == 400 and not purged, (route, body, r.text)
    dry = [v for k, v in body + query if k == "dry_run"]
    if r.status_code != 200 or any(_as_query_reads("dry_run", v) is True for v in dry):
        assert not purged, (route, body, query, r.text)
    return r.status_code
