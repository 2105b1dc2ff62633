"""`cachemgr status` with a namespace dir its user cannot read (chmod 000, another user's 0700):
it used to stop at "ID: Permission denied" (exit 2) and show none of the others. It reports
that namespace as unreadable, counts the others, and exits 1: a report that is not whole, as
`purge --all` that left damaged namespaces alone does (docs/exit-codes.md). `ls` used to show
the same namespace (or one whose manifest it may not read) and exit 0; both now say it in one
warning line on stderr and exit 1.

Bound by mode bits as test_unusable_ns's daemon is: uid 0 without the DAC capabilities.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cachemgr.layout import Layout
from tests.daemon_helpers import NS_A, NS_B, page_name, register_namespace, store_page
from tests.polling import wait_for
from tests.reliability.test_unusable_ns import base, capless, daemon

PAGES = "cachemgr_namespace_pages"

__all__ = ["base"]  # the fixture, used by name


def _two_namespaces(base: Path) -> Layout:
    layout = Layout.at(base / "root")
    for ns in (NS_A, NS_B):
        d = layout.ns_dir(ns) if ns == NS_A else register_namespace(layout, ns, instance="b")
        for i in range(3):
            store_page(d, page_name(i), size=1000)
    return layout


def test_status_reports_an_unreadable_namespace_and_counts_the_others(base: Path) -> None:
    layout = _two_namespaces(base)
    layout.ns_dir(NS_A).chmod(0o000)
    try:
        as_json = capless(layout.root, "status", "--port", "1", "--json")
        table = capless(layout.root, "status", "--port", "1", "--wide")
    finally:
        layout.ns_dir(NS_A).chmod(0o755)
    assert "Traceback" not in as_json.stderr + table.stderr
    assert as_json.returncode == 1, as_json.stderr
    by_id = {ns["id"]: ns for ns in json.loads(as_json.stdout)["namespaces"]}
    assert by_id[NS_A]["state"] == "unreadable", by_id[NS_A]
    assert "Permission denied" in by_id[NS_A]["problem"], by_id[NS_A]
    assert by_id[NS_B]["pages"] == 3 and by_id[NS_B]["bytes"] == 3000, by_id[NS_B]
    assert table.returncode == 1, table.stderr
    assert NS_B in table.stdout and NS_A in table.stdout, table.stdout
    assert _warnings(table) == [f"namespace {NS_A} cannot be read by uid 0: Permission denied"]
    assert _warnings(as_json) == _warnings(table)
    assert "cachemgr: error" not in table.stderr, table.stderr


def _warnings(out: subprocess.CompletedProcess[str]) -> list[str]:
    """The warning lines on stderr (none on stdout: --json stays JSON, the table a table)."""
    assert "warning" not in out.stdout, out.stdout
    lines = out.stderr.splitlines()
    return [ln.removeprefix("cachemgr: warning: ") for ln in lines if "warning:" in ln]


@pytest.mark.parametrize("unreadable", ["dir", "manifest"])
def test_ls_and_status_say_an_unreadable_namespace_and_exit_1(base: Path, unreadable: str) -> None:
    layout = _two_namespaces(base)
    path = layout.ns_dir(NS_A) if unreadable == "dir" else layout.manifest(NS_A)
    mode = path.stat().st_mode
    path.chmod(0o000)
    try:
        runs = {
            "ls --json": capless(layout.root, "ls", "--json"),
            "ls": capless(layout.root, "ls", "--wide"),
            "status --json": capless(layout.root, "status", "--port", "1", "--json"),
            "status": capless(layout.root, "status", "--port", "1", "--wide"),
        }
        doctor = capless(layout.root, "doctor", "--json")
    finally:
        path.chmod(mode)
    what = "" if unreadable == "dir" else "manifest "
    said = f"namespace {NS_A} {what}cannot be read by uid 0: Permission denied"
    for name, out in runs.items():
        assert out.returncode == 1, (name, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr and "cachemgr: error" not in out.stderr, out.stderr
        assert _warnings(out) == [said], (name, out.stderr)
        assert NS_A in out.stdout and NS_B in out.stdout, (name, out.stdout)
    listed = {ns["ns_id"]: ns for ns in json.loads(runs["ls --json"].stdout)["namespaces"]}
    assert listed[NS_A]["state"] == "unreadable", listed[NS_A]
    assert listed[NS_A]["problem"] == said.removeprefix(f"namespace {NS_A} "), listed[NS_A]
    assert listed[NS_B]["state"] == "bound" and listed[NS_B]["pages"] == 3, listed[NS_B]
    statuses = {ns["id"]: ns for ns in json.loads(runs["status --json"].stdout)["namespaces"]}
    assert statuses[NS_A]["state"] == "unreadable", statuses[NS_A]
    assert statuses[NS_B]["pages"] == 3, statuses[NS_B]
    findings = [f for f in json.loads(doctor.stdout) if f["code"] == "ns-unusable"]
    assert [NS_A in f["message"] for f in findings] == [True], doctor.stdout
    ls_row, status_row = _row(runs["ls"], NS_A), _row(runs["status"], NS_A)
    if unreadable == "dir":  # its pages were not counted: not 0, and the same in all four
        assert [listed[NS_A][k] for k in ("pages", "bytes", "temps")] == [None] * 3, listed
        assert statuses[NS_A]["pages"] is None and statuses[NS_A]["bytes"] is None, statuses
        assert (ls_row["pages"], ls_row["size"]) == ("?", "?"), ls_row
        assert (status_row["pages"], status_row["size"]) == ("?", "?"), status_row
    else:  # the dir was counted; the model is the DB's copy of the identity, said so
        assert listed[NS_A]["pages"] == statuses[NS_A]["pages"] == 3, (listed, statuses)
        assert (ls_row["pages"], status_row["pages"]) == ("3", "3"), (ls_row, status_row)
        assert listed[NS_A]["model"] == listed[NS_B]["model"] == "Qwen/Qwen3-8B", listed
        assert listed[NS_A]["identity_from"] == "registry", listed[NS_A]
        assert listed[NS_B]["identity_from"] == "manifest", listed[NS_B]
        assert (ls_row["model"], ls_row["page"]) == ("Qwen/Qwen3-8B (registry)", "64"), ls_row


def _row(out: subprocess.CompletedProcess[str], ns: str) -> dict[str, str]:
    """The cells of `ns`'s row in a --wide table, by column header."""
    lines = out.stdout.splitlines()
    (header,) = [ln for ln in lines if ln.startswith("┃")]
    (row,) = [ln for ln in lines if ln.startswith(f"│ {ns} ")]
    names = [c.strip() for c in header.strip("┃").split("┃")]
    return dict(zip(names, (c.strip() for c in row.strip("│").split("│")), strict=True))


def test_the_daemon_says_a_dir_it_cannot_read_uncounted(base: Path, free_port: int) -> None:
    """Its /v1/status called such a namespace active with 0 pages (none indexed), and
    `status` showed that 0 and exited 0: it is unreadable, its counts null, left out of the
    totals and the pages gauge, and `status` says it and exits 1 as it does from disk."""
    layout = _two_namespaces(base)
    layout.ns_dir(NS_A).chmod(0o000)
    try:
        with daemon(layout.root, free_port, base / "daemon.log") as d:
            report = d.http.get("/v1/status").json()
            # the metrics are refreshed on their own clock: B counted first, then read A
            wait_for(lambda: d.metric(PAGES, namespace=NS_B), lambda v: v == 3, what="B's")
            pages_a = d.metric(PAGES, namespace=NS_A)
            as_json = capless(layout.root, "status", "--port", str(free_port), "--json")
            table = capless(layout.root, "status", "--port", str(free_port), "--wide")
    finally:
        layout.ns_dir(NS_A).chmod(0o755)
    by_id = {ns["id"]: ns for ns in report["namespaces"]}
    assert by_id[NS_A]["state"] == "unreadable", by_id[NS_A]
    assert by_id[NS_A]["problem"] == "cannot be read by uid 0: Permission denied", by_id[NS_A]
    counts = ("pages", "bytes", "temp_files", "foreign_files", "corrupt_files")
    assert [by_id[NS_A][k] for k in counts] == [None] * 5, by_id[NS_A]
    assert by_id[NS_B]["pages"] == 3 and by_id[NS_B]["state"] == "active", by_id[NS_B]
    assert report["totals"]["pages"] == 3 and report["totals"]["bytes"] == 3000, report["totals"]
    assert pages_a is None  # no sample: not a 0
    assert json.loads(as_json.stdout)["source"] == "daemon", as_json.stdout
    assert json.loads(as_json.stdout)["namespaces"][0] == by_id[NS_A]
    for out in (as_json, table):
        assert out.returncode == 1, (out.args, out.stderr)
        assert _warnings(out) == [f"namespace {NS_A} cannot be read by uid 0: Permission denied"]
    row = _row(table, NS_A)
    assert (row["pages"], row["size"]) == ("?", "?"), row


def test_ls_with_every_namespace_readable_exits_0(base: Path) -> None:
    layout = _two_namespaces(base)
    out = capless(layout.root, "ls", "--json")
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert {ns["state"] for ns in json.loads(out.stdout)["namespaces"]} == {"bound"}


def test_status_with_every_namespace_readable_exits_0(base: Path) -> None:
    layout = _two_namespaces(base)
    out = capless(layout.root, "status", "--port", "1", "--json")
    assert out.returncode == 0, out.stderr
    assert {ns["state"] for ns in json.loads(out.stdout)["namespaces"]} == {"active"}


def test_status_and_ls_with_the_state_dir_unusable_count_the_pages_on_disk(base: Path) -> None:
    """The pages are there without the DB: status and ls show them from disk (no history),
    say why once, and exit 1; they used to stop at "state.db: Permission denied" (exit 2)."""
    layout = _two_namespaces(base)
    layout.state_dir.chmod(0o000)
    try:
        status = capless(layout.root, "status", "--port", "1", "--json")
        table = capless(layout.root, "status", "--port", "1")
        ls = capless(layout.root, "ls", "--json")
        ls_table = capless(layout.root, "ls")
    finally:
        layout.state_dir.chmod(0o755)
    for out in (status, table, ls, ls_table):
        assert out.returncode == 1, (out.args, out.stderr)
        assert "Traceback" not in out.stderr and "cachemgr: error" not in out.stderr, out.stderr
    by_id = {ns["id"]: ns for ns in json.loads(status.stdout)["namespaces"]}
    assert by_id[NS_B]["pages"] == 3 and by_id[NS_B]["bytes"] == 3000, by_id
    assert by_id[NS_A]["pages"] == 3, by_id
    listed = {ns["ns_id"]: ns for ns in json.loads(ls.stdout)["namespaces"]}
    assert listed[NS_B]["pages"] == 3, listed
    for out in (status, table, ls, ls_table):
        (warning,) = _warnings(out)
        assert warning.startswith(f"state dir {layout.state_dir} cannot be used"), warning
        assert "shown from disk alone" in warning, warning
