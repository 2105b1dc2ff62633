"""A failure no route expected (a state DB another process broke) is a problem+json 500 and
one log line: no text/plain 500, no traceback to the client or the log, nothing of the
exception (SQL, paths) in the body but the id of the log line that has it, and the client's
keep-alive connection still works. Against the real daemon on a loopback port."""

from __future__ import annotations

import logging
import sqlite3

import pytest

from cachemgr.layout import Layout
from cachemgr.settings import Settings
from tests.daemon_helpers import NS_A, page_name, register_namespace, running_daemon, store_page

PROBLEM = "application/problem+json"
# Each reads the bindings table: the status, the fingerprints, a GC run and a purge's plan.
FAILING = [
    ("GET", "/v1/status", None),
    ("GET", "/v1/fingerprint", None),
    ("POST", "/v1/gc", None),
    ("POST", "/v1/purge", {"all": True, "dry_run": True}),
]


def test_an_unexpected_failure_is_a_problem_500_and_one_log_line(
    settings: Settings,
    layout: Layout,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    d = register_namespace(layout, NS_A, instance="gpu0")
    store_page(d, page_name(0))
    with running_daemon(settings) as dm:
        # Another process breaks the schema under the daemon (a hand edit, a bad tool).
        conn = sqlite3.connect(layout.db_path)
        conn.execute("ALTER TABLE bindings RENAME TO bindings_gone")
        conn.commit()
        conn.close()
        caplog.clear()
        ids = []
        with caplog.at_level(logging.ERROR, logger="cachemgr.daemon.problems"):
            for method, route, body in FAILING:
                r = dm.http.request(method, route, json=body)
                assert r.status_code == 500, (route, r.text)
                assert r.headers["content-type"] == PROBLEM, route
                problem = r.json()
                assert problem["status"] == 500 and problem["title"] == "internal error"
                for internal in ("bindings", "OperationalError", "SELECT", str(layout.root)):
                    assert internal not in r.text, (route, r.text)
                assert problem["error_id"] in problem["detail"]
                ids.append(problem["error_id"])
                # the same keep-alive connection answers the next request
                assert dm.get("/healthz").status_code == 200
        lines = [r for r in caplog.records if r.name == "cachemgr.daemon.problems"]
        assert [  # each log line has the cause, under the id its answer gave
            (r.getMessage(), r.route, r.error_id)  # type: ignore[attr-defined]
            for r in lines
        ] == [
            ("http request failed", route, i) for (_, route, _), i in zip(FAILING, ids, strict=True)
        ]
        assert all("no such table: bindings" in r.error for r in lines)  # type: ignore[attr-defined]
        assert len(set(ids)) == len(ids)
        assert all(r.exc_info is None for r in lines)
    assert "Exception in ASGI application" not in capfd.readouterr().err  # uvicorn's traceback
