"""The shipped Kubernetes and compose examples' users, with vLLM 0.34.0's real fs tier
(tests/vllm_driver.py): cachemgr as uid 10001 (runAsUser, and in fsGroup 10001), the volume
dir `2775 root:10001`, vLLM as root with the examples' `umask 0002`. GC keeps the cap on the
blocks vLLM wrote. A writer forced to umask 022 (the examples before they set one) makes its
hashed dirs 2755: GC cannot delete there and says so (a warning in the run and its log line,
cachemgr_gc_refused_files_total, a short run, `gc` exiting 1, a doctor finding)."""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from tests.conftest import VLLM_ENV, VllmDriver, start_driver
from tests.daemon_helpers import register_namespace
from tests.gc_helpers import page_bytes
from tests.polling import wait_for
from tests.test_server import metric
from tests.users import User, as_user, cli_as, daemon_as, needs_root, shared_dir, shared_root

pytestmark = [pytest.mark.vllm, needs_root]
REPO = Path(__file__).resolve().parent.parent
EXAMPLES = ("deploy/vllm/kubernetes/deployment.yaml", "deploy/vllm/docker-compose.yml")


def examples_umask() -> int:
    """The umask the examples' vLLM container sets before `exec vllm serve` (one for all)."""
    found = set()
    for example in EXAMPLES:
        text = (REPO / example).read_text()
        m = re.search(r"umask (0[0-7]{3}) && .*?exec vllm serve", text, re.S)
        assert m, f"{example}: the vLLM container sets no umask"
        found.add(int(m.group(1), 8))
    (umask,) = found
    return umask


CACHEMGR = User(uid=10001, gids=(10001,), umask=0o022)  # the image's user, a container's umask
ENGINE = User(uid=0, gids=(0,), umask=examples_umask())  # the examples' vLLM container
FORCED_022 = User(uid=0, gids=(0,), umask=0o022)
GOOD, BAD = "00000000000000b1", "00000000000000b2"
BLOCK = 4096  # the driver's block_bytes
CAP = 100_000  # per namespace: each has its own writer


def identity(name: str) -> dict[str, object]:
    return {
        "engine": "vllm",
        "kv_cache_dtype": "bfloat16",
        "page_size": 16,
        "source": {"served_model_name": name},
    }


@pytest.fixture
def writers() -> Iterator[dict[str, VllmDriver]]:
    """vLLM's fs tier as the examples' root with umask 0002, and one forced to umask 022."""
    users = {"engine": ENGINE, "forced": FORCED_022}
    # Both start before either is awaited: each import of vLLM takes 10-20 s.
    procs = {
        name: start_driver(VLLM_ENV, "vllm-env.sh", "vllm_driver.py", "VLLM_", user)
        for name, user in users.items()
    }
    started: dict[str, VllmDriver] = {}
    try:
        for name, proc in procs.items():
            started[name] = VllmDriver(proc)
        yield started
    finally:
        for proc in procs.values():  # both told to exit before either is waited for
            if proc.stdin is not None:
                proc.stdin.close()
        for driver in started.values():
            driver.close()
        for name, proc in procs.items():
            if name not in started:  # its peer failed first: not left running
                proc.kill()
                proc.wait()
                if proc.stdout is not None:
                    proc.stdout.close()


def prepare(root: Path) -> tuple[Path, Path]:
    """What cachemgr-init does as uid 10001: the skeleton and two vLLM namespaces."""
    layout = Layout.at(root)
    create_root(layout)
    good = register_namespace(layout, GOOD, instance="vllm-0", identity=identity("good"))
    bad = register_namespace(layout, BAD, instance="vllm-1", identity=identity("bad"))
    return good, bad


# The sidecar's settings: the examples' kind of cap (smaller), quicker cycles for the test.
DAEMON_ENV = {
    "CACHEMGR_GC_NAMESPACE_MAX_BYTES": str(CAP),
    "CACHEMGR_GC_INTERVAL": "0.5",
    "CACHEMGR_GC_MIN_AGE": "0s",
    "CACHEMGR_BATCH_INTERVAL": "0.05",
}


def write(driver: VllmDriver, ns_dir: Path) -> None:
    """5 prompts of 12 blocks (240 kB), more than twice the cap."""
    tier = driver.open(ns_dir, block_tokens=16, dtype="bfloat16", slots=128)["handle"]
    try:
        for s in range(5):
            assert driver.call("store", handle=tier, tokens=[[s, 16 * 12]], tag="a")["failed"] == 0
    finally:
        driver.call("close", handle=tier)


def hashed_dirs(ns_dir: Path) -> list[os.stat_result]:
    return [p.stat() for p in ns_dir.rglob("*") if p.is_dir() and any(p.glob("*.bin"))]


def test_the_examples_users_keep_the_cap_and_umask_022_is_loud(
    writers: dict[str, VllmDriver], free_port: int, capfd: pytest.CaptureFixture[str]
) -> None:
    with shared_dir("cachemgr-vllm-users-") as top:
        root = shared_root(top, owner=0, group=10001)  # fsGroup's volume root: 2775 root:10001
        good, bad = as_user(CACHEMGR, lambda: prepare(root))
        with daemon_as(CACHEMGR, root, free_port, DAEMON_ENV) as url:
            write(writers["engine"], good)
            write(writers["forced"], bad)
            held = "GC to hold the cap on the blocks vLLM wrote as root with umask 0002"
            wait_for(lambda: page_bytes(good), lambda n: n <= CAP, timeout=60, what=held)

            def refused() -> float:
                text = httpx.get(f"{url}/metrics", timeout=5).text
                return metric(text, "cachemgr_gc_refused_files_total", reason="permission") or 0

            wait_for(refused, lambda n: n > 0, timeout=60, what="refusals in the metric")
            text = httpx.get(f"{url}/metrics", timeout=5).text
            assert (metric(text, "cachemgr_gc_runs_total", result="short") or 0) > 0
            assert page_bytes(bad) > CAP  # the refusals were real: nothing could go there
        assert {stat.S_IMODE(s.st_mode) for s in hashed_dirs(good)} == {0o2775}
        assert {stat.S_IMODE(s.st_mode) for s in hashed_dirs(bad)} == {0o2755}
        logs = [json.loads(ln) for ln in capfd.readouterr().err.splitlines() if ln.startswith("{")]
        done = [r for r in logs if r.get("msg") == "gc done" and r.get("refused")]
        assert done and done[0]["level"] == "warning" and done[0]["held"] is False
        assert any(f"ns/{BAD} cannot be deleted by uid 10001" in w for w in done[0]["warnings"])
        assert all(f"ns/{GOOD}" not in w for r in done for w in r["warnings"])

        out = cli_as(CACHEMGR, "--root", str(root), "gc", "--yes", "--namespace-max-bytes", "100kB")
        assert out.returncode == 1, out.stderr
        assert f"files in ns/{BAD} cannot be deleted by uid 10001" in out.stderr
        assert "the limit was not held" in out.stderr and "Traceback" not in out.stderr

        doctor = cli_as(CACHEMGR, "--root", str(root), "doctor", "--json")
        findings = [f for f in json.loads(doctor.stdout) if f["code"] == "gc-cannot-delete"]
        assert doctor.returncode == 2 and len(findings) == 1
        (finding,) = findings
        assert f"pages in ns {BAD} cannot be deleted by uid 10001" in finding["message"]
        assert "the writer's umask is 022" in finding["message"]
        assert "umask 0002" in finding["fix"] and f"chmod -R g+w {root}/ns/{BAD}" in finding["fix"]
