"""deploy/kubernetes: schema-valid for k8s >= 1.29, and wired as init step + native sidecar."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
KUSTOMIZE = REPO / "deploy" / "kubernetes"
OVERLAY = KUSTOMIZE / "overlays" / "prometheus-operator"
# The first release with native sidecars on by default, and the newest schema bundled.
K8S_VERSIONS = ["1.29.0", "1.37.0"]

Doc = dict[str, Any]


def render_by_hand(directory: Path) -> list[Doc]:
    """A small kustomize: resources (files and directories), images and plain labels."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[Doc] = []
    for res in kust.get("resources", []):
        path = directory / res
        if path.is_dir():
            docs += render_by_hand(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    images = {i["name"]: i for i in kust.get("images", [])}
    for doc in docs:
        for entry in kust.get("labels", []):
            doc["metadata"].setdefault("labels", {}).update(entry["pairs"])
        for c in pod_containers(doc):
            name, _, tag = c["image"].partition(":")
            if name in images:
                img = images[name]
                c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag)}"
    return docs


def render(directory: Path) -> list[Doc]:
    """`kubectl kustomize` where kubectl exists (it does on this machine), else by hand."""
    by_hand = render_by_hand(directory)
    if shutil.which("kubectl") is None:
        return by_hand
    out = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, docs)) == sorted(map(key, by_hand))
    return docs


def pod_containers(doc: Doc) -> list[Doc]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def one(docs: list[Doc], kind: str) -> Doc:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return render(KUSTOMIZE)


def test_every_manifest_validates_against_the_kubernetes_schema(docs: list[Doc]) -> None:
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "Secret", "ConfigMap"}
    for doc in docs:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_a_broken_manifest(docs: list[Doc]) -> None:
    bad = copy.deepcopy(one(docs, "Deployment"))
    bad["spec"]["template"]["spec"]["initContainers"][1]["restartPolicy"] = ["Always"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)


def test_init_step_then_native_sidecar_then_server(docs: list[Doc]) -> None:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    init, sidecar = pod["initContainers"]
    (server,) = pod["containers"]
    assert "restartPolicy" not in init  # a plain init container: runs to completion first
    assert sidecar["restartPolicy"] == "Always"  # native sidecar: lives as long as the pod
    init_cmd = " ".join(init["command"] + init["args"])
    assert "cachemgr init" in init_cmd and "--env-file /run/cachemgr/env" in init_cmd
    assert '--sglang-version "$SGLANG_VERSION" -- python3 -m sglang.launch_server $SGLANG_ARGS' in (
        init_cmd
    )
    server_cmd = " ".join(server["command"] + server["args"])
    assert ". /run/cachemgr/env" in server_cmd and "set -a" in server_cmd
    assert server_cmd.endswith("exec python3 -m sglang.launch_server $SGLANG_ARGS")
    assert sidecar["args"] == ["serve"]
    # Both read the launch arguments from the same ConfigMap: one identity, one command.
    for c in (init, server):
        assert c["envFrom"] == [{"configMapRef": {"name": "sglang-launch"}}]


def test_launch_args_enable_the_l3_file_cache_with_pages_that_can_hit(docs: list[Doc]) -> None:
    args = one(docs, "ConfigMap")["data"]["SGLANG_ARGS"].split()
    for flag in ["--enable-hierarchical-cache", "--enable-metrics"]:
        assert flag in args
    assert args[args.index("--hicache-storage-backend") + 1] == "file"
    assert int(args[args.index("--page-size") + 1]) > 1  # page size 1 never hits (FIELD_NOTES)
    assert args[args.index("--host") + 1] == "0.0.0.0"


def test_sglang_version_matches_the_server_image_tag(docs: list[Doc]) -> None:
    version = one(docs, "ConfigMap")["data"]["SGLANG_VERSION"]
    server = pod_containers(one(docs, "Deployment"))[-1]
    name, _, tag = server["image"].partition(":")
    assert name == "lmsysorg/sglang" and tag.startswith(f"v{version}-")


def test_cache_volume_is_shared_and_the_env_dir_handed_over(docs: list[Doc]) -> None:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    init, sidecar, server = pod_containers(one(docs, "Deployment"))
    mounts = {c["name"]: {m["name"]: m for m in c["volumeMounts"]} for c in (init, sidecar, server)}
    (root,) = {m["hicache"]["mountPath"] for m in mounts.values()}  # one path in all three
    for c in (init, sidecar):
        assert {"name": "CACHEMGR_ROOT", "value": root} in c["env"]
    assert mounts["cachemgr-init"]["cachemgr-env"]["mountPath"] == "/run/cachemgr"
    assert mounts["sglang"]["cachemgr-env"]["readOnly"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["cachemgr-env"]
    claim = volumes["hicache"]["persistentVolumeClaim"]["claimName"]
    assert claim in {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    assert pod["securityContext"]["fsGroup"] == 10001  # the image's UID owns the cache


def test_sidecar_binds_the_pod_ip_with_the_token_and_is_probed(docs: list[Doc]) -> None:
    _, sidecar, server = pod_containers(one(docs, "Deployment"))
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["CACHEMGR_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    ref = env["CACHEMGR_TOKEN"]["valueFrom"]["secretKeyRef"]
    secret = one(docs, "Secret")
    assert secret["metadata"]["name"] == ref["name"] and ref["key"] in secret["stringData"]
    assert secret["stringData"][ref["key"]].startswith("REPLACE-ME")  # a documented placeholder
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert sidecar["startupProbe"]["httpGet"]["path"] == "/readyz"
    assert server["livenessProbe"]["httpGet"]["path"] == "/health"


def test_the_sidecar_has_room_for_the_seed_s_dir(docs: list[Doc]) -> None:
    """The seed's dir is ~11M pages: a first start indexed 10M in 620 s with a peak RSS of
    973 MiB (bench/RESULTS.md). A startup probe that gives up sooner, or a memory limit under
    that, restarts the sidecar into the same scan for ever."""
    _, sidecar, _ = pod_containers(one(docs, "Deployment"))
    probe = sidecar["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 3600
    limit = sidecar["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and int(limit[:-2]) >= 2


def test_cachemgr_runs_locked_down_and_everything_has_requests(docs: list[Doc]) -> None:
    for c in pod_containers(one(docs, "Deployment")):
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert c["resources"]["limits"]["memory"]
        if c["image"].startswith("cachemgr"):
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"]
            assert sc["runAsUser"] == 10001 and sc["capabilities"]["drop"] == ["ALL"]
            assert not sc["allowPrivilegeEscalation"]
    server = pod_containers(one(docs, "Deployment"))[-1]
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_service_and_scrape_config_point_at_the_metrics_ports(docs: list[Doc]) -> None:
    dep = one(docs, "Deployment")
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    ports = {p["name"]: p["containerPort"] for c in pod_containers(dep) for p in c.get("ports", [])}
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["cachemgr"]
    service = one(docs, "Service")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"http", "cachemgr"}


def test_servicemonitor_overlay_scrapes_both_service_ports() -> None:
    docs = render(OVERLAY)
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    service = one(docs, "Service")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    endpoints = {e["port"]: e for e in monitor["spec"]["endpoints"]}
    assert set(endpoints) == service_ports
    # One Service, two jobs: the rules tell cachemgr and SGLang apart by the job label.
    jobs = {port: e["relabelings"][0] for port, e in endpoints.items()}
    assert jobs["cachemgr"] == {"targetLabel": "job", "replacement": "cachemgr"}
    assert jobs["http"] == {"targetLabel": "job", "replacement": "sglang"}
    # The rules group by cachemgr's own `namespace` label, not the pod's Kubernetes namespace.
    assert endpoints["cachemgr"]["honorLabels"] is True
    # The CRD is not in the Kubernetes schema; everything else in the overlay still is.
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(monitor, K8S_VERSIONS[0], strict=True)
    for doc in docs:
        if doc is not monitor:
            kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


@pytest.mark.parametrize("manifest", ["kubernetes/base", "kubernetes/fleet", "vllm/kubernetes"])
def test_no_sidecar_readiness_takes_the_server_out_of_service(manifest: str) -> None:
    """A native sidecar's readiness is its pod's: a cachemgr /readyz 503 (a state dir it may not
    use, a dead worker, a long rescan) would take the server behind the same Service out of
    it. Its startup probe still holds the server until the index is live."""
    docs = render(REPO / "deploy" / manifest)
    pods = [d for d in docs if d["kind"] in ("Deployment", "DaemonSet")]
    sidecars = [
        c
        for pod in pods
        for c in pod["spec"]["template"]["spec"].get("initContainers", [])
        if c.get("restartPolicy") == "Always"
    ]
    assert sidecars, manifest
    for sidecar in sidecars:
        assert "readinessProbe" not in sidecar
        assert sidecar["startupProbe"]["httpGet"]["path"] == "/readyz"
        assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"
