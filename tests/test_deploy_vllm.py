"""deploy/vllm/: the Kubernetes and compose examples for vLLM, schema-checked by the real tools
and run for real: init as the init step spells it, then the server command as spelled, with a
stub `vllm` that records what it was started with."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from cachemgr.settings import Settings
from tests.deploy_model import make_model
from tests.test_deploy import DEPLOY, compose_config, full_cap_fits
from tests.test_deploy_kubernetes import K8S_VERSIONS, Doc, one, pod_containers, render
from tests.test_deploy_launch import Host

KUSTOMIZE = DEPLOY / "vllm" / "kubernetes"
COMPOSE = DEPLOY / "vllm" / "docker-compose.yml"
STUB = """#!/bin/sh
# Stands in for vLLM's CLI: records its argv, then exits.
exec "{python}" -c 'import json, sys; json.dump(sys.argv[1:], open("{out}", "w"))' "$@"
"""


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return render(KUSTOMIZE)


def vllm_host(tmp_path: Path) -> Host:
    host = Host(tmp_path)
    make_model(tmp_path / "models" / "Qwen3-8B")
    stub = tmp_path / "stubs" / "vllm"
    stub.write_text(STUB.format(python=sys.executable, out=host.record))
    stub.chmod(0o755)
    return host


def check_started(host: Host, root: Path, config: dict[str, str]) -> str:
    """vLLM got the launch arguments and a --kv-transfer-config whose fs tier is the namespace
    init made for the same launch."""
    argv: list[str] = json.loads(host.record.read_text())
    assert argv[:2] == ["serve", config["VLLM_MODEL"]]
    assert argv[2:-2] == config["VLLM_ARGS"].split()
    assert argv[-2] == "--kv-transfer-config"
    given, got = json.loads(config["VLLM_KV_TRANSFER_CONFIG"]), json.loads(argv[-1])
    (tier,) = got["kv_connector_extra_config"].pop("secondary_tiers")
    given["kv_connector_extra_config"].pop("secondary_tiers")
    assert got == given  # the rest of the config is the operator's, untouched
    ns_dir = Path(tier["root_dir"])
    assert ns_dir.parent == root / "ns" and ns_dir.is_dir()
    manifest = json.loads((root / "ns" / f"{ns_dir.name}.json").read_text())
    assert manifest["identity"]["engine"] == "vllm"
    assert manifest["identity"]["vllm_version"] == config["VLLM_VERSION"].rsplit(".", 1)[0]
    return ns_dir.name


def test_every_manifest_validates_against_the_kubernetes_schema(docs: list[Doc]) -> None:
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "Secret", "ConfigMap"}
    for doc in docs:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_kubernetes_init_container_sidecar_then_server(tmp_path: Path, docs: list[Doc]) -> None:
    host = vllm_host(tmp_path)
    data = one(docs, "ConfigMap")["data"]
    paths = {"/run/cachemgr": tmp_path / "run", "/models/": f"{tmp_path}/models/"}
    (tmp_path / "run").mkdir()
    config = {k: host.map(v, paths) for k, v in data.items()}
    init, sidecar, server = pod_containers(one(docs, "Deployment"))
    assert "restartPolicy" not in init and sidecar["restartPolicy"] == "Always"
    assert sidecar["args"] == ["serve"]
    env = {e["name"]: e["value"] for e in init["env"] if "value" in e}
    assert env.pop("CACHEMGR_ROOT") == "/var/cache/vllm-kv"
    argv = [host.map(a, paths) for a in init["command"] + init["args"]]
    out = host.run(argv, {**config, **env, "CACHEMGR_ROOT": str(host.root)})
    assert "created ns" in out.stdout + out.stderr
    host.run([host.map(a, paths) for a in server["command"] + server["args"]], config)
    ns = check_started(host, host.root, config)
    # A pod restart with the same identity: the same namespace, nothing purged.
    host.run(argv, {**config, "CACHEMGR_ROOT": str(host.root)})
    assert [p.name for p in (host.root / "ns").iterdir() if p.is_dir()] == [ns]
    # The sidecar caps the root: vLLM's tier has no cap of its own.
    sidecar_env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert sidecar_env["CACHEMGR_GC_MAX_BYTES"] and sidecar_env["CACHEMGR_INSTANCE"] == "vllm"


def test_vllm_version_matches_the_server_image_tag(docs: list[Doc]) -> None:
    version = one(docs, "ConfigMap")["data"]["VLLM_VERSION"]
    server = pod_containers(one(docs, "Deployment"))[-1]
    assert server["image"] == f"vllm/vllm-openai:v{version}"
    server = yaml.safe_load(compose_config(COMPOSE, CACHEMGR_TOKEN="t").stdout)["services"]["vllm"]
    assert server["image"] == f"vllm/vllm-openai:v{server['environment']['VLLM_VERSION']}"


def test_compose_refuses_to_start_without_a_token() -> None:
    out = compose_config(COMPOSE, MODELS_DIR="/srv/models")
    assert out.returncode != 0 and "CACHEMGR_TOKEN" in out.stderr


def test_compose_init_service_then_server(tmp_path: Path) -> None:
    host = vllm_host(tmp_path)
    out = compose_config(COMPOSE, CACHEMGR_TOKEN="t", MODELS_DIR=str(tmp_path / "models"))
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    paths = {"/run/cachemgr": tmp_path / "run", "/models/": f"{tmp_path}/models/"}
    (tmp_path / "run").mkdir()
    init, server = services["cachemgr-init"], services["vllm"]
    config = {k: host.map(v, paths) for k, v in init["environment"].items()}
    image_env = {"CACHEMGR_ROOT": str(host.root)}  # the Dockerfile's ENV, at the volume
    unescape = lambda argv: [host.map(a.replace("$$", "$"), paths) for a in argv]  # noqa: E731
    host.run(unescape(init["entrypoint"] + init["command"]), {**config, **image_env})
    host.run(unescape(server["entrypoint"] + server["command"]), config)
    check_started(host, host.root, config)


def test_compose_gives_the_daemon_open_files_for_its_connection_cap() -> None:
    compose: dict[str, Any] = yaml.safe_load(compose_config(COMPOSE, CACHEMGR_TOKEN="t").stdout)
    nofile = compose["services"]["cachemgr"]["ulimits"]["nofile"]
    assert full_cap_fits(int(nofile["soft"]), int(nofile["hard"])), nofile


def test_every_cachemgr_variable_is_a_setting(docs: list[Doc]) -> None:
    compose: dict[str, Any] = yaml.safe_load(compose_config(COMPOSE, CACHEMGR_TOKEN="t").stdout)
    names = {e["name"] for doc in docs for c in pod_containers(doc) for e in c.get("env", [])}
    names |= {k for svc in compose["services"].values() for k in svc.get("environment", {})}
    ours = {n for n in names if n.startswith("CACHEMGR_")}
    fields = {f"CACHEMGR_{f.upper()}" for f in Settings.model_fields}
    assert "CACHEMGR_GC_MAX_BYTES" in ours and ours <= fields, sorted(ours - fields)
