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
from tests.reliability.test_unusable_ns import base, capless

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
