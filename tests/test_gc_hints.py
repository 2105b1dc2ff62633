"""What the CLI says under a running daemon is true: `POST /v1/gc` takes the limits `gc` does
(checked the same way), the conflict shows the exact curl that passes them, a dry run names
the real GC leader, and doctor sees the daemon's cap. The real daemon on a loopback port."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from cachemgr.cli.gc import _LIMITS
from cachemgr.daemon.api import GcRequest
from cachemgr.layout import Layout
from cachemgr.settings import Settings, load_settings
from tests.daemon_helpers import (
    NS_A,
    RunningDaemon,
    page_name,
    register_namespace,
    running_daemon,
    store_page,
)
from tests.nsfixtures import cli
from tests.polling import wait_for
from tests.test_identity import make_model
from tests.vllm_launch import launch, vinit_json

PAGE = 1024
AUTH = {"Authorization": "Bearer s3cret"}  # the token of the daemon that has one
PAGES = 10


def _pages(layout: Layout) -> int:
    return len(list(layout.ns_dir(NS_A).glob("*.bin")))


@pytest.fixture
def full(layout: Layout) -> Layout:
    d = register_namespace(layout, NS_A, instance="gpu0")
    for i in range(PAGES):
        store_page(d, page_name(i), size=PAGE)
    return layout


def _uncapped(root: Path, **more: object) -> Settings:
    return load_settings(root=root, gc_interval=3600, gc_min_age=0, **more)


def _evictable(dm: RunningDaemon) -> None:
    """Wait until the daemon would evict under a 4 kB cap: it leaves pages stored in the last
    seconds alone (in flight, cachemgr.gc.chains)."""
    wait_for(
        lambda: dm.post("/v1/gc", json={"max_bytes": "4kB", "dry_run": True}, headers=AUTH).json(),
        lambda r: r.get("by_reason", {}).get("cap", {}).get("files", 0) >= 6,
        timeout=30,
    )


def test_the_http_limits_are_the_cli_gc_limits() -> None:
    """One list: every limit `cachemgr gc` takes as a flag, POST /v1/gc takes in its body."""
    flags = {setting for _, setting, _ in _LIMITS}
    assert {f"gc_{name}" for name in GcRequest.model_fields} - {"gc_dry_run"} == flags


def test_post_gc_with_a_one_off_cap_deletes_under_it(full: Layout) -> None:
    with running_daemon(_uncapped(full.root)) as dm:
        assert dm.status()["gc_limits"]["max_bytes"] is None
        _evictable(dm)  # a dry run with the one-off cap plans evictions, and deletes nothing
        assert _pages(full) == PAGES
        r = dm.post("/v1/gc", json={"max_bytes": "4kB"})
        assert r.status_code == 200, r.text
        assert r.json()["by_reason"]["cap"]["files"] == PAGES - _pages(full)
        assert _pages(full) * PAGE <= 4000
        assert dm.status()["gc_limits"]["max_bytes"] is None  # for that run only
        # Without a limit the daemon's own (none) holds: nothing more goes.
        left = _pages(full)
        assert dm.post("/v1/gc").status_code == 200 and _pages(full) == left


def test_the_schema_bounds_a_limit_as_the_settings_do() -> None:
    for name in ("min_free_percent", "min_free_inodes_percent", "delete_rate"):
        schema = GcRequest.model_json_schema()["properties"][name]
        bounds = {k: v for k, v in schema.items() if k.endswith("imum")}
        settings_field = Settings.model_json_schema()["properties"][f"gc_{name}"]
        if "anyOf" in settings_field:  # optional (delete_rate: unset means unpaced)
            settings_field = settings_field["anyOf"][0]
        assert bounds == {k: v for k, v in settings_field.items() if k.endswith("imum")}, name


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-bytes", "lots"),
        ("--max-bytes", "-5"),
        ("--namespace-max-bytes", "10 parsecs"),
        ("--min-free-percent", "100"),
        ("--min-free-percent", "-1"),
        ("--min-age", "-5"),
        ("--min-age", "soon"),
        ("--tmp-ttl", "1y"),
        ("--delete-rate", "0"),
        ("--max-bytes", "4kB"),
        ("--min-age", "1h30m"),
        ("--min-free-percent", "2.5"),
    ],
)
def test_a_limit_is_checked_over_http_as_the_cli_checks_it(
    full: Layout, flag: str, value: str
) -> None:
    by_cli = cli("--root", str(full.root), "gc", "--dry-run", flag, value)
    name = flag.removeprefix("--").replace("-", "_")
    kind = next(k for f, _, k in _LIMITS if f == flag)
    with running_daemon(_uncapped(full.root)) as dm:
        as_json = kind(value) if kind is float and _is_number(value) else value
        r = dm.post("/v1/gc", json={name: as_json, "dry_run": True})
    assert by_cli.returncode in (0, 2), by_cli.stderr
    if by_cli.returncode == 2:
        assert r.status_code == 422, r.text
        loc = r.json()["errors"][0]["loc"]
        assert loc[0] == "body" and name in loc, loc
    else:
        assert r.status_code == 200, r.text
    assert _pages(full) == PAGES


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def test_a_gc_refused_under_the_daemon_prints_the_curl_that_passes_the_cap(
    full: Layout,
) -> None:
    with running_daemon(_uncapped(full.root, token="s3cret")) as dm:
        port = str(dm.daemon.port)
        env = {"CACHEMGR_PORT": port, "CACHEMGR_TOKEN": "s3cret"}
        out = cli("--root", str(full.root), "gc", "--max-bytes", "4kB", "--yes", env=env)
        assert out.returncode == 1 and _pages(full) == PAGES
        hint = out.stderr.split("ask the daemon: ", 1)[1].split(", or use --dry-run")[0]
        assert "$CACHEMGR_TOKEN" in hint and "s3cret" not in hint
        _evictable(dm)
        assert hint.startswith("curl -X POST") and f"127.0.0.1:{port}/v1/gc" in hint
        # The hint, run as printed by a shell with the token in its env, keeps the cap.
        shell_env = {"CACHEMGR_TOKEN": "s3cret", "PATH": "/usr/bin:/bin"}
        ran = subprocess.run(
            ["bash", "-c", hint], capture_output=True, text=True, timeout=60, env=shell_env
        )
        assert ran.returncode == 0, ran.stderr
        assert json.loads(ran.stdout)["by_reason"]["cap"]["files"] == PAGES - _pages(full)
        assert _pages(full) * PAGE <= 4000
        assert shlex.split(hint)[0] == "curl"


@pytest.mark.parametrize("token", ["s3cret\n", "s3cret\r\n", "\ts3cret \n"])
def test_the_curl_hint_sends_the_token_the_daemon_reads(full: Layout, token: str) -> None:
    """A token from a secret file keeps its newline in the env (`--from-file`, an env file
    edited on Windows): the daemon strips it, and the hint's curl sent it as it was."""
    with running_daemon(_uncapped(full.root, token=token)) as dm:
        env = {"CACHEMGR_PORT": str(dm.daemon.port), "CACHEMGR_TOKEN": token}
        out = cli("--root", str(full.root), "gc", "--max-bytes", "4kB", "--yes", env=env)
        assert out.returncode == 1 and _pages(full) == PAGES
        hint = out.stderr.split("ask the daemon: ", 1)[1].split(", or use --dry-run")[0]
        _evictable(dm)
        shell_env = {"CACHEMGR_TOKEN": token, "PATH": "/usr/bin:/bin"}
        ran = subprocess.run(
            ["sh", "-c", hint], capture_output=True, text=True, timeout=60, env=shell_env
        )
        assert ran.returncode == 0, ran.stderr
        cap = json.loads(ran.stdout).get("by_reason", {}).get("cap", {})
        assert cap.get("files") == PAGES - _pages(full) > 0, ran.stdout


def test_a_dry_run_names_the_real_leader(full: Layout) -> None:
    alone = cli("--root", str(full.root), "gc", "--dry-run", "--json")
    assert json.loads(alone.stdout)["leader"] is True
    with running_daemon(_uncapped(full.root)) as dm:
        out = cli("--root", str(full.root), "gc", "--dry-run", "--json", "--max-bytes", "4kB")
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert report["leader"] is False
        assert str(report["holder"]).startswith("pid ")
        assert report["files"] >= 6  # the plan is shown all the same
        # The leader daemon's own dry run says it leads.
        assert dm.post("/v1/gc", json={"dry_run": True}).json()["leader"] is True
    assert _pages(full) == PAGES


def test_doctor_sees_the_cap_of_the_daemon_serving_the_root(root: Path, tmp_path: Path) -> None:
    model = make_model(tmp_path / "model")
    command = vinit_json(root, launch(model))["command"]
    env = {"CACHEMGR_GC_MAX_BYTES": ""}  # this shell sets no cap
    before = cli("--root", str(root), "doctor", "--json", "--", *command, env=env)
    assert "fs-tier-uncapped" in before.stdout
    with running_daemon(_uncapped(root, gc_max_bytes="400GB")) as dm:
        env["CACHEMGR_PORT"] = str(dm.daemon.port)
        out = cli("--root", str(root), "doctor", "--json", "--", *command, env=env)
        assert [f["code"] for f in json.loads(out.stdout)] == [], out.stdout
        assert out.returncode == 0
