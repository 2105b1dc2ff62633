"""A state dir the daemon cannot read while it runs (a chmod, a remount, another user's
volume): `POST /v1/gc` used to answer a bare 500. It is a 503 problem+json that names the
cause, and /readyz says the daemon is not ready until the state dir can be read again.

The daemon runs bound by mode bits, as in test_unusable_ns.
"""

from __future__ import annotations

import json
from pathlib import Path

from cachemgr.layout import Layout
from tests.daemon_helpers import NS_A
from tests.polling import wait_for
from tests.reliability.test_unusable_ns import base, capless, daemon

__all__ = ["base"]  # the fixture, used by name


def test_gc_with_the_state_dir_unreadable_is_a_503_naming_it(base: Path, free_port: int) -> None:
    layout = Layout.at(base / "root")
    with daemon(layout.root, free_port, base / "daemon.log") as d:
        layout.state_dir.chmod(0o000)
        try:
            r = d.http.post("/v1/gc", json={})
            readyz = wait_for(
                lambda: d.http.get("/readyz"),
                lambda a: a.status_code == 503,
                timeout=30,
                what="/readyz not ready",
            )
        finally:
            layout.state_dir.chmod(0o755)
        assert r.status_code == 503, r.text
        assert r.headers["content-type"] == "application/problem+json"
        detail = r.json()["detail"]
        assert str(layout.state_dir) in detail and "\n" not in detail, detail
        assert str(layout.state_dir) in readyz.json()["detail"], readyz.text
        wait_for(
            lambda: d.http.get("/readyz").status_code,
            lambda code: code == 200,
            timeout=30,
            what="ready again",
        )
        assert d.http.post("/v1/gc", json={}).status_code == 200
        assert d.alive()


def test_doctor_with_the_state_dir_unreadable_reports_it_and_the_rest(base: Path) -> None:
    """It used to stop at 'state.db: Permission denied', with nothing else checked."""
    layout = Layout.at(base / "root")
    layout.ns_dir(NS_A).chmod(0o000)  # a finding that needs no DB: it must still be made
    layout.state_dir.chmod(0o000)
    try:
        out = capless(layout.root, "doctor", "--json")
    finally:
        layout.state_dir.chmod(0o755)
        layout.ns_dir(NS_A).chmod(0o755)
    assert out.returncode == 2 and out.stderr == "", out.stderr
    findings = {f["code"]: f for f in json.loads(out.stdout)}
    state = findings["state-unreadable"]
    assert state["severity"] == "error" and str(layout.state_dir) in state["message"]
    assert "chmod" in state["fix"], state
    assert NS_A in findings["ns-unusable"]["message"], findings
