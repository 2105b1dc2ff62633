"""deploy/kubernetes/fleet: schema-valid, a DaemonSet over a ReadWriteMany volume whose
sidecars elect through a Lease they may get, create and update (and nothing more), with the
state DB node-local."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from cachemgr.settings import Settings
from tests.deploy_promql import Exposition, promql_refs, rule_exprs
from tests.polling import wait_for
from tests.test_deploy import DEPLOY, compose_config
from tests.test_deploy_kubernetes import K8S_VERSIONS, KUSTOMIZE, one, render

Doc = dict[str, Any]


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return render(KUSTOMIZE / "fleet")


def test_every_fleet_manifest_validates(docs: list[Doc]) -> None:
    kinds = {d["kind"] for d in docs}
    assert kinds == {"DaemonSet", "ServiceAccount", "Role", "RoleBinding", "PersistentVolumeClaim"}
    for doc in docs:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_lease_rbac_is_get_create_update_on_leases_only(docs: list[Doc]) -> None:
    (rule,) = one(docs, "Role")["rules"]
    assert rule == {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "create", "update"],
    }
    binding = one(docs, "RoleBinding")
    sa = one(docs, "ServiceAccount")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa}]
    assert one(docs, "DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"] == sa


def test_sidecars_lead_through_kubernetes_with_a_local_state_dir(docs: list[Doc]) -> None:
    spec = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    _, sidecar = spec["initContainers"]
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["CACHEMGR_FLEET_COORDINATOR"]["value"] == "kubernetes"
    assert env["CACHEMGR_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "CACHEMGR_TOKEN" in env  # followers post to the leader with it
    names = {n.removeprefix("CACHEMGR_").lower() for n in env if n.startswith("CACHEMGR_")}
    assert names <= set(Settings.model_fields)
    state = next(
        m for m in sidecar["volumeMounts"] if m["mountPath"] == env["CACHEMGR_STATE_DIR"]["value"]
    )
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[state["name"]]  # node-local, not the shared claim
    claim = volumes["hicache"]["persistentVolumeClaim"]["claimName"]
    pvc = one(docs, "PersistentVolumeClaim")
    assert pvc["metadata"]["name"] == claim and pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_each_node_binds_its_server_before_it_starts(docs: list[Doc]) -> None:
    # Unbound, the shared namespace would be GC's to drop as unused (gc_keep_unbound): each
    # node's init binds `sglang@<node>` and hands the namespace dir to its server.
    spec = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    init, sidecar = spec["initContainers"]
    (server,) = spec["containers"]
    assert "restartPolicy" not in init and sidecar["restartPolicy"] == "Always"
    init_cmd = " ".join(init["command"] + init["args"])
    assert "cachemgr init --instance sglang --env-file /run/cachemgr/env" in init_cmd
    assert init_cmd.endswith("-- python3 -m sglang.launch_server $SGLANG_ARGS")
    server_cmd = " ".join(server["command"] + server["args"])
    assert "set -a && . /run/cachemgr/env" in server_cmd
    assert server_cmd.endswith("exec python3 -m sglang.launch_server $SGLANG_ARGS")
    env = {c["name"]: {e["name"]: e for e in c["env"]} for c in (init, sidecar)}
    for name in ("CACHEMGR_ROOT", "CACHEMGR_STATE_DIR", "CACHEMGR_FLEET_COORDINATOR"):
        assert env["cachemgr-init"][name] == env["cachemgr"][name], name  # one node, one view
    node = env["cachemgr-init"]["CACHEMGR_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert node == "spec.nodeName"
    mounts = {c["name"]: {m["name"]: m for m in c["volumeMounts"]} for c in (init, sidecar)}
    assert mounts["cachemgr-init"]["cachemgr-state"] == mounts["cachemgr"]["cachemgr-state"]
    assert {m["name"]: m for m in server["volumeMounts"]}["cachemgr-env"]["readOnly"] is True
    for c in (init, server):
        assert c["envFrom"] == [{"configMapRef": {"name": "sglang-launch"}}]


def test_the_compose_fleet_example_resolves_and_names_only_settings() -> None:
    out = compose_config(
        DEPLOY / "compose" / "fleet-etcd.yml",
        CACHEMGR_TOKEN="t",
        NODE_NAME="gpu-1",
        NODE_IP="10.0.0.7",
        SHARED_CACHE="/mnt/hicache",
        ETCD_ENDPOINTS="10.0.0.5:2379",
    )
    assert out.returncode == 0, out.stderr
    env = yaml.safe_load(out.stdout)["services"]["cachemgr"]["environment"]
    assert env["CACHEMGR_FLEET_COORDINATOR"] == "etcd://10.0.0.5:2379"
    names = {n.removeprefix("CACHEMGR_").lower() for n in env}
    assert names <= set(Settings.model_fields)
    assert env["CACHEMGR_STATE_DIR"] != env["CACHEMGR_ROOT"]


PROMTOOL_TESTS = """
rule_files: [{rules}]
evaluation_interval: 15s
tests:
  - interval: 15s
    input_series:
      - series: 'cachemgr_fleet_leader{{instance="a"}}'
        values: '1x8 0x12'
      - series: 'cachemgr_fleet_leader{{instance="b"}}'
        values: '0x20'
      - series: 'cachemgr_fleet_summary_age_seconds{{instance="a",node="b"}}'
        values: '0.3x4 70x8'
    alert_rule_test:
      - eval_time: 1m
        alertname: CachemgrFleetNoLeader
        exp_alerts: []
      - eval_time: 1m
        alertname: CachemgrFleetNodeSilent
        exp_alerts: []
      - eval_time: 2m15s
        alertname: CachemgrFleetNodeSilent
        exp_alerts:
          - exp_labels: {{severity: warning, instance: a, node: b}}
            exp_annotations:
              summary: fleet node b has sent no accesses for over a minute
              description: >-
                The leader has had no summary from b for over a minute: its reads and stores
                do not reach the eviction order, so pages only it uses look cold and go first.
              runbook: >-
                On that node: is cachemgr up, and does it reach the leader's URL (`GET
                /v1/fleet` shows `leader_url`; `cachemgr_fleet_accesses_buffered` grows while
                it cannot)? Check the token is the same on every node (the leader answers 401
                otherwise) and fleet_advertise_url on the leader.
      - eval_time: 4m
        alertname: CachemgrFleetNoLeader
        exp_alerts:
          - exp_labels: {{severity: critical}}
            exp_annotations:
              summary: no cachemgr node leads the fleet's GC
              description: >-
                No node has held the GC lease for a minute: nothing is deleted, so the shared
                cache grows past its cap and the free-space floor is not kept.
              runbook: >-
                Check the coordinator: `cachemgr_fleet_coordinator_up` is 0 on every node when
                etcd or the Kubernetes API does not answer (etcdctl endpoint health; kubectl
                get lease cachemgr-gc). With the coordinator up, read the nodes' logs for "lost
                the fleet's GC lease" and check the Lease RBAC (get, create, update on leases).
      - eval_time: 4m
        alertname: CachemgrFleetTwoLeaders
        exp_alerts: []
  - interval: 15s
    input_series:
      - series: 'cachemgr_fleet_leader{{instance="a"}}'
        values: '1x12 0x8'
      - series: 'cachemgr_fleet_leader{{instance="b"}}'
        values: '0x20'
      - series: 'cachemgr_fleet_ship_age_seconds{{instance="a"}}'
        values: '0x20'
      - series: 'cachemgr_fleet_ship_age_seconds{{instance="b"}}'
        values: '1x3 30+15x16'
    alert_rule_test:
      - eval_time: 1m30s
        alertname: CachemgrFleetNodeNotShipping
        exp_alerts: []
      - eval_time: 2m45s
        alertname: CachemgrFleetNodeNotShipping
        exp_alerts:
          - exp_labels: {{severity: warning, instance: b}}
            exp_annotations:
              summary: cachemgr on b has reached no fleet leader for over a minute
              description: >-
                A leader is up, but it has taken nothing from b for over a minute (an idle
                node sends an empty summary every 5 s), so that node is silent to it, even if
                the leader never heard of it: its reads and stores do not reach the eviction
                order, and pages only it uses look cold and go first.
              runbook: >-
                On that node, `GET /v1/fleet` names the leader and its URL: check it is
                reachable from there (fleet_advertise_url on the leader), that the token is
                the same on every node (the leader answers 401 otherwise), and the node's log
                for "accesses not shipped" (debug level).
      - eval_time: 4m45s
        alertname: CachemgrFleetNodeNotShipping
        exp_alerts: []
"""


def test_fleet_alerts_fire_when_a_node_is_silent_and_when_nobody_leads(tmp_path: Path) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (scripts/test-deps.sh installs prometheus)")
    rules = DEPLOY / "prometheus" / "fleet" / "cachemgr-fleet-alerts.yml"
    (tmp_path / "t.yml").write_text(PROMTOOL_TESTS.format(rules=json.dumps(str(rules))))
    out = subprocess.run(
        ["promtool", "test", "rules", "t.yml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


FLEET_ROW = "Fleet"


def fleet_row_exprs() -> list[tuple[str, str]]:
    """The queries of the dashboard's fleet row (the panels below its row, to the next row)."""
    dashboard = json.loads((DEPLOY / "grafana" / "cachemgr.json").read_text())
    found: list[tuple[str, str]] = []
    inside = False
    for p in dashboard["panels"]:
        if p["type"] == "row":
            inside = p["title"] == FLEET_ROW
        elif inside:
            found += [(p["title"], t["expr"]) for t in p["targets"]]
    return found


@pytest.mark.fleet
def test_the_fleet_row_and_alerts_query_what_a_live_fleet_serves(tmp_path: Path) -> None:
    """Scrapes of a real two-node fleet (etcd, bindfs nodes): a leader and a follower."""
    from tests.test_fleet import fleet, leaders

    rules = yaml.safe_load(
        (DEPLOY / "prometheus" / "fleet" / "cachemgr-fleet-alerts.yml").read_text()
    )
    queries = [*fleet_row_exprs(), *rule_exprs(rules["groups"])]
    assert len(fleet_row_exprs()) >= 8
    with fleet(tmp_path, 2) as (_, _, daemons):
        wait_for(lambda: leaders(daemons), lambda ls: len(ls) == 1, timeout=20)
        # the follower's first heartbeat (it has nothing else to ship) names it on the leader
        wait_for(lambda: "node=" in "".join(d.get("/metrics").text for d in daemons), timeout=20)
        scrapes = [Exposition.parse(d.get("/metrics").text) for d in daemons]
    names = set().union(*(s.names for s in scrapes))
    labels = set().union(*(s.labels for s in scrapes)) | {"job", "instance"}
    for where, expr in queries:
        refs = promql_refs(expr)
        assert refs.metrics and refs.metrics <= names, f"{where}: {sorted(refs.metrics - names)}"
        assert refs.labels <= labels, f"{where}: labels {sorted(refs.labels - labels)}"
