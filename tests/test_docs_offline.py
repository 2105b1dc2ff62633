"""The daemon's API page (/docs) renders in a real headless browser on a host with no network:
every asset comes from the daemon itself.

Chromium resolves no name but 127.0.0.1, so nothing leaves loopback, and its NetLog records
every request the page made: a page that loads Swagger UI or ReDoc from a CDN asks for it
there (and stays blank).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cachemgr.settings import Settings
from tests.daemon_helpers import RunningDaemon, running_daemon

CHROMIUM = shutil.which("chromium")


def render_offline(origin: str, path: str, tmp: Path) -> tuple[str, list[str]]:
    """The DOM of the page at `origin + path` after its scripts ran (virtual time: no fixed
    wait), and the URLs the page asked for, with no name resolving but 127.0.0.1."""
    assert CHROMIUM is not None
    netlog = tmp / "netlog.json"
    argv = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        f"--user-data-dir={tmp / 'profile'}", f"--log-net-log={netlog}",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--virtual-time-budget=15000", "--dump-dom", origin + path,
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout, page_requests(json.loads(netlog.read_text()), origin + path, origin)


def page_requests(log: dict[str, Any], url: str, origin: str) -> list[str]:
    """URLs in a NetLog that the page at `url` asked for: its own load and what it initiated
    (the browser's own background requests have no initiator and are left out)."""
    types = {v: k for k, v in log["constants"]["logEventTypes"].items()}
    starts = [
        e.get("params", {}) for e in log["events"] if types[e["type"]] == "URL_REQUEST_START_JOB"
    ]
    return [
        p["url"] for p in starts if "url" in p and (p["url"] == url or p.get("initiator") == origin)
    ]


def assert_served_by(daemon: RunningDaemon, requests: list[str], *paths: str) -> None:
    elsewhere = [u for u in requests if not u.startswith(f"{daemon.url}/")]
    assert elsewhere == [], "the page asked for these off the daemon"
    for path in paths:
        assert f"{daemon.url}{path}" in requests


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/test-deps.sh)")
def test_swagger_ui_lists_the_operations_offline(settings: Settings, tmp_path: Path) -> None:
    # A daemon of its own: the browser's parallel requests start worker threads that end with it.
    with running_daemon(settings) as daemon:
        dom, requests = render_offline(daemon.url, "/docs", tmp_path)
    assert_served_by(daemon, requests, "/docs", "/openapi.json")
    assert 'class="opblock ' in dom
    assert 'data-path="/v1/status"' in dom
    assert 'data-path="/v1/gc"' in dom


def test_docs_page_names_only_the_daemons_files_and_there_is_no_redoc(
    settings: Settings,
) -> None:
    with running_daemon(settings) as daemon:
        page = daemon.get("/docs")
        assets = re.findall(r"(?:src|href|url)\s*[=:]\s*['\"]([^'\"]+)['\"]", page.text)
        # Paths on this host only (asked of nothing else), each one the daemon serves.
        assert [a for a in assets if not re.match(r"/[^/]", a)] == []
        fetched = {a: daemon.get(a).status_code for a in assets}
        redoc = daemon.get("/redoc")
    assert page.status_code == 200
    assert len(assets) >= 3  # script, style, icon (and the OpenAPI document)
    assert fetched == dict.fromkeys(assets, 200)
    assert redoc.status_code == 404
