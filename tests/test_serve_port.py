"""`serve` on a port in use says who holds it: this root's daemon, another root's, or another
program; one line, exit 2, and it names --port."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest

from cachemgr.layout import Layout
from cachemgr.settings import Settings, load_settings
from tests.daemon_helpers import running_daemon


def serve(root: Path, port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cachemgr", "--root", str(root), "serve", "--port", str(port)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def test_this_roots_daemon_already_serves_it(settings: Settings, layout: Layout) -> None:
    with running_daemon(settings) as dm:
        port = dm.daemon.port
        r = serve(layout.root, port)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"cachemgr: error: port {port} on 127.0.0.1 is in use: a cachemgr daemon already "
        f"serves this root ({layout.root}) there; use it, or stop it first, or pick another "
        "port with --port"
    ]


def test_another_roots_daemon(settings: Settings, layout: Layout, tmp_path: Path) -> None:
    other = tmp_path / "other-root"
    with running_daemon(load_settings(root=other, log_format="json")) as dm:
        port = dm.daemon.port
        r = serve(layout.root, port)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"cachemgr: error: port {port} on 127.0.0.1 is in use: a cachemgr daemon serving "
        f"another root ({other}) listens there; give this one its own port with --port"
    ]


def test_another_program(layout: Layout) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        r = serve(layout.root, port)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"cachemgr: error: port {port} on 127.0.0.1 is in use by another program (not a "
        "cachemgr daemon); pick another port with --port (0 picks a free one)"
    ]


def test_the_daemon_runs_on_asyncio_where_uvloop_is_installed(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # uvicorn's "auto" loop takes uvloop when it imports (beside vLLM it does); the fd budget
    # counts asyncio's accepts.
    made: list[object] = []

    def new_event_loop() -> asyncio.AbstractEventLoop:
        made.append(True)
        return asyncio.new_event_loop()

    monkeypatch.setitem(sys.modules, "uvloop", types.SimpleNamespace(new_event_loop=new_event_loop))
    with running_daemon(settings) as dm:
        assert dm.http.get("/healthz").status_code == 200
    assert made == []
