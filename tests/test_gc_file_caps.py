"""The file caps (gc_max_files, gc_namespace_max_files) are one-off limits of `cachemgr gc` and
of POST /v1/gc, as the byte caps are: checked by the same settings model (a bad one is exit 2
/ a 422 naming it), held for that run only. The real daemon on a loopback port."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from cachemgr.layout import Layout
from cachemgr.settings import Settings, load_settings
from tests.daemon_helpers import (
    NS_A,
    cli_argv,
    page_name,
    register_namespace,
    running_daemon,
    store_page,
)
from tests.nsfixtures import cli
from tests.test_gc_hints import _evictable
from tests.test_gc_refusals import immutable

PAGES = 10


@pytest.fixture
def full(layout: Layout) -> Layout:
    d = register_namespace(layout, NS_A, instance="gpu0")
    for i in range(PAGES):
        store_page(d, page_name(i), size=1024)
    return layout


def _pages(layout: Layout) -> int:
    return len(list(layout.ns_dir(NS_A).glob("*.bin")))


def _uncapped(root: Path) -> Settings:
    return load_settings(root=root, gc_interval=3600, gc_min_age=0)


@pytest.mark.parametrize("flag", ["--max-files", "--namespace-max-files"])
def test_cli_gc_takes_a_one_off_file_cap(full: Layout, flag: str) -> None:
    planned = cli("--root", str(full.root), "gc", "--dry-run", "--json", flag, "4")
    assert planned.returncode == 0, planned.stderr
    assert _pages(full) == PAGES
    out = cli("--root", str(full.root), "gc", "--yes", flag, "4", env={"CACHEMGR_GC_MIN_AGE": "0"})
    assert out.returncode == 0, out.stderr
    assert 0 < _pages(full) <= 4


@pytest.mark.parametrize("name", ["max_files", "namespace_max_files"])
def test_post_gc_takes_a_one_off_file_cap_for_that_run_only(full: Layout, name: str) -> None:
    with running_daemon(_uncapped(full.root)) as dm:
        _evictable(dm)
        r = dm.post("/v1/gc", json={name: 4})
        assert r.status_code == 200, r.text
        assert 0 < _pages(full) <= 4
        assert r.json()["by_reason"]["files"]["files"] == PAGES - _pages(full)
        assert dm.status()["gc_limits"][name] is None  # the daemon's own cap is unchanged


@pytest.mark.parametrize("value", ["0", "1.5", "-3", "lots", "10000000000000"])
@pytest.mark.parametrize("flag", ["--max-files", "--namespace-max-files"])
def test_a_bad_file_cap_is_refused_by_the_cli_and_over_http(
    full: Layout, flag: str, value: str
) -> None:
    by_cli = cli("--root", str(full.root), "gc", "--dry-run", flag, value)
    assert by_cli.returncode == 2 and "Traceback" not in by_cli.stderr, by_cli.stderr
    name = flag.removeprefix("--").replace("-", "_")
    with running_daemon(_uncapped(full.root)) as dm:
        as_json: object = value
        for kind in (int, float):
            try:
                as_json = kind(value)
                break
            except ValueError:
                continue
        r = dm.post("/v1/gc", json={name: as_json, "dry_run": True})
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    # One error at the field: not also pydantic's union members (a validator's repr with a
    # memory address in the location, "Input should be None" for the optional body and field).
    assert [e["loc"] for e in r.json()["errors"]] == [["body", name]], r.text
    assert _pages(full) == PAGES


def test_the_curl_printed_under_the_daemon_passes_the_file_cap_it_takes(full: Layout) -> None:
    with running_daemon(_uncapped(full.root)) as dm:
        env = {"CACHEMGR_PORT": str(dm.daemon.port)}
        out = cli("--root", str(full.root), "gc", "--max-files", "4", "--yes", env=env)
        assert out.returncode == 1 and _pages(full) == PAGES, out.stderr
        body = out.stderr.split(" -d ", 1)[1].split(" http", 1)[0]
        assert json.loads(shlex.split(body)[0]) == {"max_files": 4}, out.stderr
        _evictable(dm)
        r = dm.post("/v1/gc", json=json.loads(shlex.split(body)[0]))
        assert r.status_code == 200 and 0 < _pages(full) <= 4, r.text


def test_the_dry_run_of_a_cap_in_a_dir_gc_cannot_write_is_the_short_run_it_plans(
    full: Layout,
) -> None:
    """A namespace dir GC may not unlink in (chattr +i here; another user's dir with umask
    022 in a deploy): the dry run said it would delete 7 files and held the cap, while the
    real run deleted none and exited 1. It must refuse the same files, held: false."""
    args = ("--root", str(full.root), "gc", "--json", "--max-files", "4")
    env = {"CACHEMGR_GC_MIN_AGE": "0"}
    with immutable(full.ns_dir(NS_A)):
        dry = cli(*args, "--dry-run", env=env)
        real = cli(*args, "--yes", env=env)
    assert dry.returncode == 0 and real.returncode == 1, (dry.stderr, real.stderr)
    d, r = json.loads(dry.stdout), json.loads(real.stdout)
    assert (d["held"], d["files"]) == (r["held"], r["files"]) == (False, 0)
    assert [len(s["refused"]) for s in d["steps"]] == [len(s["refused"]) for s in r["steps"]]
    assert sum(len(s["refused"]) for s in r["steps"]) == PAGES - math.floor(4 * 0.85)
    assert _pages(full) == PAGES


def test_gc_on_a_terminal_exits_1_when_its_cap_cannot_be_held(full: Layout) -> None:
    """On a terminal `cachemgr gc` previews first and stops when nothing can go: a cap whose
    files are all refused must still exit 1 with the warning, as `gc --yes` does."""
    argv = [*cli_argv(full.root), "gc", "--max-files", "4"]
    env = {**os.environ, "CACHEMGR_GC_MIN_AGE": "0"}
    with immutable(full.ns_dir(NS_A)):
        out = subprocess.run(
            ["script", "-qec", shlex.join(argv), "/dev/null"],
            capture_output=True,
            text=True,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    assert out.returncode == 1, out.stdout
    assert f"the limit was not held: {PAGES - math.floor(4 * 0.85)} files" in out.stdout
    assert _pages(full) == PAGES


def test_the_inode_floor_is_a_one_off_limit_of_the_cli(full: Layout) -> None:
    """As the free-space floor's --min-free-percent: `cachemgr gc --min-free-inodes-percent`
    keeps an inode floor for that run (one no filesystem meets here: every page goes, for
    reason free_inodes, from the floor pass, and the run says it did not hold the floor), and
    a bad one is refused in one line."""
    args = ("--root", str(full.root), "gc", "--json", "--min-free-inodes-percent")
    bad = cli(*args, "101", "--dry-run")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert "less than 100" in bad.stderr
    out = cli(*args, "99.99", "--yes", env={"CACHEMGR_GC_MIN_AGE": "0"})
    assert out.returncode == 1, out.stderr
    assert "the limit was not held: free_inodes still over" in out.stderr
    report = json.loads(out.stdout)
    assert report["by_reason"]["free_inodes"]["files"] == PAGES
    assert not report["held"]
    assert [(u["limit"], u["namespace_id"], u["unit"]) for u in report["unmet"]] == [
        ("free_inodes", None, "files")
    ]
    assert _pages(full) == 0


def test_post_gc_takes_a_one_off_inode_floor_for_that_run_only(full: Layout) -> None:
    with running_daemon(_uncapped(full.root)) as dm:
        assert dm.status()["gc_limits"]["min_free_inodes_percent"] == 0  # the suite's
        _evictable(dm)
        bad = dm.post("/v1/gc", json={"min_free_inodes_percent": 100, "dry_run": True})
        assert bad.status_code == 422, bad.text
        assert "min_free_inodes_percent" in bad.json()["errors"][0]["loc"], bad.text
        r = dm.post("/v1/gc", json={"min_free_inodes_percent": 99.99})
        assert r.status_code == 200, r.text
        assert r.json()["by_reason"]["free_inodes"]["files"] == PAGES
        assert not r.json()["held"] and r.json()["unmet"][0]["limit"] == "free_inodes"
        assert _pages(full) == 0
        # A one-off limit missed is the request's answer, not the daemon's own limits' state.
        assert dm.status()["gc_unmet"] == []
        assert 'cachemgr_gc_limits_unmet{limit="free_inodes"} 0.0' in dm.get("/metrics").text
        assert dm.status()["gc_limits"]["min_free_inodes_percent"] == 0
