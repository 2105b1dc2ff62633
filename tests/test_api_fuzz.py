"""Fuzz the HTTP API from its committed OpenAPI document (schemathesis) against the running
daemon: no 5xx, and no response outside the documented schema, content type or status."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import Case
from schemathesis.specs.openapi.checks import positive_data_acceptance

from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from tests.daemon_helpers import (
    NS_A,
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
    skip = [positive_data_acceptance] if _query_contradicts_body(case) else []
    case.call_and_validate(base_url=daemon.url, excluded_checks=skip)


def _query_contradicts_body(case: Case) -> bool:
    """A field the query and the body both give, with different values: a 422 by design (a
    real purge or GC is never a guess), which OpenAPI cannot state across parameters and body."""
    body = case.body if isinstance(case.body, dict) else {}
    return any(
        name in body and _text(body[name]) != _text(value)
        for name, value in (case.query or {}).items()
    )


def _text(value: object) -> str:
    """A value as the query string carries it."""
    return json.dumps(value) if isinstance(value, bool) else str(value)
