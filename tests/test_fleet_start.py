"""Fleet mode at start: a coordinator setting that cannot work is one line and exit 2, never a
traceback; a coordinator that does not answer yet leaves the daemon serving, not leading, and
says why. Real `cachemgr serve` processes; the etcd that is down is a closed loopback port."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest

from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from tests.daemon_helpers import captured_log, running_daemon
from tests.fleet_bed import bindfs_nodes, free_port, need_binaries, running_etcd
from tests.polling import wait_for
from tests.test_fleet import node_settings

pytestmark = pytest.mark.fleet


def serve(tmp: Path, coordinator: str, *, pre: str = "") -> subprocess.CompletedProcess[str]:
    """`cachemgr serve` in fleet mode, outside any pod (`pre`: Python run before the CLI)."""
    root, state = tmp / "root", tmp / "state"
    create_root(Layout.at(root, state))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env |= {
        "CACHEMGR_FLEET_COORDINATOR": coordinator,
        "CACHEMGR_NODE_NAME": "node0",
        "CACHEMGR_STATE_DIR": str(state),
        "KUBECONFIG": str(tmp / "no-kube-config"),
        "HOME": str(tmp),
    }
    code = f"{pre}from cachemgr.cli.main import main; main()"
    argv = [sys.executable, "-c", code, "--root", str(root), "serve", "--port", "0"]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("coordinator", "says"),
    [
        ("etcd://", "want HOST:PORT"),
        ("etcd://host:notaport", "want HOST:PORT"),
        ("kubernetes", "no service account (not in a pod?) and no usable kube config"),
    ],
)
def test_a_coordinator_that_cannot_work_is_one_line_and_exit_2(
    tmp_path: Path, coordinator: str, says: str
) -> None:
    out = serve(tmp_path, coordinator)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith("cachemgr: error: ") and says in line, line


def test_without_the_fleet_extra_the_error_says_how_to_get_it(tmp_path: Path) -> None:
    out = serve(
        tmp_path, "etcd://127.0.0.1:2379", pre="import sys; sys.modules['etcd3gw'] = None; "
    )
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.splitlines()
    assert "pip install 'cachemgr[fleet]'" in line, line


def test_with_etcd_down_at_start_the_daemon_serves_leads_nothing_and_says_why(
    tmp_path: Path,
) -> None:
    port = free_port()  # nothing listens there
    settings = load_settings(
        root=tmp_path / "root",
        state_dir=tmp_path / "state",
        fleet_coordinator=f"etcd://127.0.0.1:{port}",
        node_name="node0",
        fleet_lease_ttl=3.0,
        fleet_renew_interval=0.5,
    )
    create_root(Layout.at(settings.root, settings.state_dir))
    with captured_log("cachemgr.fleet.elector") as log, running_daemon(settings) as daemon:
        fleet = daemon.get("/v1/fleet").json()
        assert (fleet["leading"], fleet["coordinator_up"]) == (False, False)
        metrics = daemon.get("/metrics").text
        assert "cachemgr_fleet_coordinator_up 0.0" in metrics
        assert "cachemgr_gc_leader 0.0" in metrics
        down = wait_for(
            lambda: [x for x in log.lines if "unreachable" in str(x["msg"])], bool, timeout=10
        )
    # which endpoint, and what it said (etcd3gw's exceptions have an empty str())
    assert f"127.0.0.1:{port}: ConnectionFailedError: " in str(down[0]["error"]), down


def test_a_second_daemon_under_the_leaders_node_name_says_so(tmp_path: Path) -> None:
    # It would take that leader for itself: never ship its accesses, and share its instances'
    # binding files. Real etcd, two bindfs nodes given one node_name.
    need_binaries()
    with ExitStack() as stack:
        etcd = stack.enter_context(running_etcd(tmp_path))
        mounts = stack.enter_context(bindfs_nodes(tmp_path / "backing", tmp_path / "mnt", 2))
        create_root(Layout.at(mounts[0], tmp_path / "state0"))
        log = stack.enter_context(captured_log("cachemgr.fleet.elector"))
        first = stack.enter_context(
            running_daemon(node_settings(mounts[0], tmp_path / "state0", etcd, 0))
        )
        wait_for(lambda: first.get("/v1/fleet").json()["leading"], bool, timeout=20)
        stack.enter_context(running_daemon(node_settings(mounts[1], tmp_path / "state1", etcd, 0)))
        said = wait_for(
            lambda: [x for x in log.lines if "under this node's name" in str(x["msg"])],
            bool,
            timeout=10,
        )
        assert said[0]["level"] == "error" and said[0]["node"] == "node0"
