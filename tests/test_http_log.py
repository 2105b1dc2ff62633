"""Every mutating HTTP call leaves one structured line in the daemon's log: the client, the
route, and what was done (or why nothing was)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from cachemgr.layout import Layout
from cachemgr.logs import JsonFormatter
from cachemgr.settings import load_settings
from tests.daemon_helpers import (
    NS_A,
    NS_B,
    page_name,
    register_namespace,
    running_daemon,
    store_page,
)


class Lines(logging.Handler):
    """The daemon's HTTP log lines as its JSON formatter writes them."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter())
        self.lines: list[dict[str, object]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@pytest.fixture
def http_log() -> Iterator[Lines]:
    logger = logging.getLogger("cachemgr.daemon.http")
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_purge_logs_who_and_what(layout: Layout, http_log: Lines) -> None:
    for ns in (NS_A, NS_B):
        d = register_namespace(layout, ns)
        for i in range(2):
            store_page(d, page_name(i), size=100)
    with running_daemon(load_settings(root=layout.root, token="s3cret")) as dm:
        auth = {"Authorization": "Bearer s3cret"}
        assert (
            dm.post("/purge", params={"dry_run": True, "all": True}, headers=auth).status_code
            == 200
        )
        assert dm.post(f"/v1/namespaces/{NS_A}/purge", headers=auth).status_code == 200
        assert dm.post("/purge", params={"namespace": "0" * 16}, headers=auth).status_code == 404
        assert dm.post("/purge").status_code == 401
        assert dm.post("/v1/gc", params={"dry_run": True}, headers=auth).status_code == 200
    dry, one, missing, refused, gc = http_log.lines
    client = dry["client"]
    assert isinstance(client, str) and client.startswith("127.0.0.1:")
    assert dry["msg"] == "http purge" and dry["route"] == "/purge"
    assert (dry["dry_run"], dry["namespaces"], dry["pages"]) == (True, [NS_A, NS_B], 4)
    assert (one["dry_run"], one["namespaces"], one["pages"], one["bytes"]) == (
        False, [NS_A], 2, 200,
    )  # fmt: skip
    assert one["route"] == f"/v1/namespaces/{NS_A}/purge"
    assert missing["msg"] == "http purge refused" and missing["status"] == 404
    assert "no namespace 0000000000000000" in str(missing["error"])
    assert refused["msg"] == "http request refused" and refused["status"] == 401
    assert gc["msg"] == "http gc" and gc["dry_run"] is True and "files" in gc and "bytes" in gc
    assert all(line["client"] for line in http_log.lines)
