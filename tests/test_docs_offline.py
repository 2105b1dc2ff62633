"""The daemon's API page (/docs) renders in a real headless browser on a host with no network:
every asset comes from the daemon itself.

Chromium resolves no name but 127.0.0.1, so nothing leaves loopback, and its NetLog records
every request the page made: a page that loads Swagger UI from a CDN asks for it there (and
stays blank). The check is on the DOM (the operation list) and on a screenshot (drawn with
Swagger UI's stylesheet).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from cachemgr.settings import Settings
from tests.daemon_helpers import RunningDaemon, running_daemon

CHROMIUM = shutil.which("chromium")


def offline_chromium(url: str, tmp: Path, *args: str) -> str:
    """Headless Chromium on `url` with no name resolving but 127.0.0.1; what it printed.
    Virtual time lets the page's scripts and requests finish without a fixed wait."""
    assert CHROMIUM is not None
    argv = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        f"--user-data-dir={tmp / 'profile'}",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--virtual-time-budget=15000",
        *args,
        url,
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout


def render_offline(origin: str, path: str, tmp: Path) -> tuple[str, list[str]]:
    """The DOM of the page at `origin + path` after its scripts ran, and the URLs it asked for."""
    netlog = tmp / "netlog.json"
    dom = offline_chromium(origin + path, tmp, f"--log-net-log={netlog}", "--dump-dom")
    return dom, page_requests(json.loads(netlog.read_text()), origin + path, origin)


def screenshot_colors(url: str, tmp: Path) -> dict[tuple[int, int, int], int]:
    """How many pixels of each colour a 1200x1400 screenshot of the page has."""
    shot = tmp / "docs.png"
    offline_chromium(url, tmp, "--window-size=1200,1400", f"--screenshot={shot}")
    with Image.open(shot) as image:
        colors = image.convert("RGB").getcolors(maxcolors=1200 * 1400)
    assert colors is not None
    return {rgb: n for n, rgb in colors}


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


# Swagger UI's colours for the method badges and the blocks of GET and POST operations.
GET_BLUE = (0x61, 0xAF, 0xFE)
POST_GREEN = (0x49, 0xCC, 0x90)


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/test-deps.sh)")
def test_swagger_ui_lists_and_draws_the_operations_offline(
    settings: Settings, tmp_path: Path
) -> None:
    # A daemon of its own: the browser's parallel requests start worker threads that end with it.
    with running_daemon(settings) as daemon:
        dom, requests = render_offline(daemon.url, "/docs", tmp_path)
        colors = screenshot_colors(f"{daemon.url}/docs", tmp_path)
    assert_served_by(daemon, requests, "/docs", "/openapi.json")
    assert 'class="opblock ' in dom
    assert 'data-path="/v1/status"' in dom
    assert 'data-path="/v1/gc"' in dom
    # Drawn with its stylesheet: 7 GET and 4 POST operations, each a badge and a border in its
    # colour (~4,000 pixels at this size), where an unstyled or blank page has none.
    assert colors.get(GET_BLUE, 0) > 7 * 2000
    assert colors.get(POST_GREEN, 0) > 4 * 2000


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
