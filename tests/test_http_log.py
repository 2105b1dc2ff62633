"""Every mutating HTTP call leaves one structured line in the daemon's log: the client, the
route, and what was done (or why nothing was)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from tests.daemon_helpers import (
    NS_A,
    NS_B,
    LogLines,
    captured_log,
    page_name,
    register_namespace,
    running_daemon,
    store_page,
)
from tests.nsfixtures import cli_process
from tests.polling import wait_for


@pytest.fixture
def http_log() -> Iterator[LogLines]:
    with captured_log("cachemgr.daemon.http") as lines:
        yield lines


def test_purge_logs_who_and_what(layout: Layout, http_log: LogLines) -> None:
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
        False,
        [NS_A],
        2,
        200,
    )
    assert one["route"] == f"/v1/namespaces/{NS_A}/purge"
    assert missing["msg"] == "http purge refused" and missing["status"] == 404
    assert "no namespace 0000000000000000" in str(missing["error"])
    assert refused["msg"] == "http request refused" and refused["status"] == 401
    assert gc["msg"] == "http gc" and gc["dry_run"] is True and "files" in gc and "bytes" in gc
    assert all(line["client"] for line in http_log.lines)


@pytest.mark.parametrize("via", ["http", "cli"])
def test_a_purged_namespace_leaves_its_real_counts_in_the_index_log(
    layout: Layout, via: str
) -> None:
    """The purge takes the index rows with the dir; the indexer's line used to say pages 0."""

    d = register_namespace(layout, NS_A)
    for i in range(3):
        store_page(d, page_name(i), size=100)
    settings = load_settings(root=layout.root, gc_interval=3600)
    with captured_log("cachemgr.daemon.indexer") as handler, running_daemon(settings) as dm:
        wait_for(lambda: dm.namespaces().get(NS_A, {}).get("pages"), lambda n: n == 3)
        if via == "http":
            assert dm.post(f"/v1/namespaces/{NS_A}/purge").status_code == 200
        else:
            out = cli_process("--root", str(layout.root), "purge", "--namespace", NS_A, "-y")
            assert out.returncode == 0, out.stderr

        def gone() -> list[dict[str, object]]:
            return [x for x in handler.lines if x["msg"] == "namespace dir gone"]

        (line,) = wait_for(gone, lambda lines: len(lines) == 1, timeout=30)
    assert (line["namespace"], line["pages"], line["bytes"]) == (NS_A, 3, 300), line
    assert str(line["removed_by"]).startswith("purge (manual, "), line
