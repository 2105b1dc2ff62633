"""The init step and the server start exactly as each deployment spells them, run for real.

Paths a deployment owns (/run, /models, the cache root, /opt) are mapped into a temp dir and
the SGLang server is a stub `python3` that records what it was started with.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.deploy_model import make_model
from tests.test_deploy import SYSTEMD, compose_config, unit
from tests.test_deploy_kubernetes import KUSTOMIZE, one, pod_containers, render

VENV_BIN = Path(sys.executable).parent
STUB = """#!/bin/sh
# Stands in for SGLang's python3: records its storage dir and argv, then exits.
exec "{python}" -c 'import json, os, sys; json.dump({{"dir": os.environ.get(
    "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"), "argv": sys.argv[1:]}}, open("{out}", "w"))' "$@"
"""


class Host:
    """A temp dir standing in for the machine a deployment runs on."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.root = tmp / "hicache"
        self.model = make_model(tmp / "models" / "Qwen3.8-27B-W4A16-AWQ")
        self.record = tmp / "server.json"
        stubs = tmp / "stubs"
        stubs.mkdir()
        python3 = stubs / "python3"
        python3.write_text(STUB.format(python=sys.executable, out=self.record))
        python3.chmod(0o755)
        self.path = f"{stubs}{os.pathsep}{VENV_BIN}{os.pathsep}{os.environ['PATH']}"

    def map(self, text: str, paths: dict[str, Path]) -> str:
        for real, fake in paths.items():
            text = text.replace(real, str(fake))
        return text

    def run(self, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEMGR_", "SGLANG_"))}
        out = subprocess.run(
            argv,
            env={**clean, **env, "PATH": self.path},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        return out

    def server(self) -> dict[str, Any]:
        started: dict[str, Any] = json.loads(self.record.read_text())
        return started


def check_started(host: Host, sglang_args: str) -> str:
    """The server got its namespace dir from init and exactly the launch arguments."""
    started = host.server()
    assert started["dir"], "the server started without SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
    ns_dir = Path(started["dir"])
    assert ns_dir.parent == host.root / "ns" and ns_dir.is_dir()
    assert (host.root / "ns" / f"{ns_dir.name}.json").is_file()  # init's manifest
    assert started["argv"] == ["-m", "sglang.launch_server", *sglang_args.split()]
    return ns_dir.name


def test_kubernetes_init_container_then_server(tmp_path: Path) -> None:
    host = Host(tmp_path)
    docs = render(KUSTOMIZE)
    data = one(docs, "ConfigMap")["data"]
    paths = {"/run/cachemgr": tmp_path / "run", "/models/": f"{tmp_path}/models/"}
    (tmp_path / "run").mkdir()
    config = {k: host.map(v, paths) for k, v in data.items()}
    init, _, server = pod_containers(one(docs, "Deployment"))
    env = {e["name"]: e["value"] for e in init["env"] if "value" in e}
    assert env.pop("CACHEMGR_ROOT") == "/var/cache/hicache"
    argv = [host.map(a, paths) for a in init["command"] + init["args"]]
    out = host.run(argv, {**config, **env, "CACHEMGR_ROOT": str(host.root)})
    assert "created ns" in out.stdout + out.stderr
    host.run([host.map(a, paths) for a in server["command"] + server["args"]], config)
    ns = check_started(host, config["SGLANG_ARGS"])
    # A pod restart with the same identity: the same namespace, nothing purged.
    host.run(argv, {**config, "CACHEMGR_ROOT": str(host.root)})
    assert [p.name for p in (host.root / "ns").iterdir() if p.is_dir()] == [ns]


def test_compose_init_service_then_server(tmp_path: Path) -> None:
    host = Host(tmp_path)
    out = compose_config(CACHEMGR_TOKEN="t", MODELS_DIR=str(tmp_path / "models"))
    services = yaml.safe_load(out.stdout)["services"]
    paths = {"/run/cachemgr": tmp_path / "run", "/models/": f"{tmp_path}/models/"}
    (tmp_path / "run").mkdir()
    init, server = services["cachemgr-init"], services["sglang"]
    volumes = {v.split(":")[1]: v.split(":")[0] for v in init["volumes"]}
    assert volumes["/models"] == str(tmp_path / "models")  # MODELS_DIR is what init hashes
    config = {k: host.map(v, paths) for k, v in init["environment"].items()}
    image_env = {"CACHEMGR_ROOT": str(host.root)}  # the Dockerfile's ENV, at the volume
    unescape = lambda argv: [host.map(a.replace("$$", "$"), paths) for a in argv]  # noqa: E731
    host.run(unescape(init["entrypoint"] + init["command"]), {**config, **image_env})
    host.run(unescape(server["entrypoint"] + server["command"]), config)
    check_started(host, config["SGLANG_ARGS"])


def systemd_env(path: Path) -> dict[str, str]:
    """An EnvironmentFile= as systemd reads it: KEY=value, double quotes removed."""
    pairs = [ln.split("=", 1) for ln in path.read_text().splitlines() if ln and ln[0] != "#"]
    return {k: v.strip('"') for k, v in pairs}


def systemd_argv(line: str, env: dict[str, str]) -> list[str]:
    """systemd's expansion of an Exec line: ${VAR} is one word, $VAR splits into words."""
    words = []
    for word in shlex.split(line):
        if word.startswith("$") and not word.startswith("${"):
            words += env[word[1:]].split()
        else:
            words.append(word.replace("${SGLANG_VERSION}", env["SGLANG_VERSION"]))
    return words


def test_systemd_exec_start_pre_then_exec_start(tmp_path: Path) -> None:
    host = Host(tmp_path)
    cachemgr_conf = tmp_path / "cachemgr.toml"
    toml = (SYSTEMD.parent / "cachemgr.toml").read_text()
    cachemgr_conf.write_text(toml.replace("/var/cache/sglang-hicache", str(host.root)))
    paths = {
        "/opt/cachemgr/bin/cachemgr": VENV_BIN / "cachemgr",
        "/opt/sglang/bin/python3": tmp_path / "stubs" / "python3",
        "/run/sglang-cachemgr": tmp_path / "run",
        "/srv/models/": f"{tmp_path}/models/",
        "/etc/cachemgr/cachemgr.toml": cachemgr_conf,
    }
    (tmp_path / "run").mkdir()
    env = {k: host.map(v, paths) for k, v in systemd_env(SYSTEMD / "sglang.env").items()}
    dropin = unit(SYSTEMD / "sglang.service.d" / "cachemgr.conf")["Service"]
    key, _, value = host.map(dropin["Environment"], paths).partition("=")
    host.run(systemd_argv(host.map(dropin["ExecStartPre"], paths), env), {**env, key: value})
    env_file = Path(host.map(dropin["EnvironmentFile"].removeprefix("-"), paths))
    server_env = {**env, **systemd_env(env_file)}  # read again before ExecStart=
    start = unit(SYSTEMD / "sglang.service")["Service"]["ExecStart"]
    host.run(systemd_argv(host.map(start, paths), server_env), server_env)
    check_started(host, env["SGLANG_ARGS"])


def test_every_form_gives_the_same_identity(tmp_path: Path) -> None:
    """The three launch specs describe one server, so init picks one namespace for all."""
    host = Host(tmp_path)
    forms = {
        "kubernetes": one(render(KUSTOMIZE), "ConfigMap")["data"]["SGLANG_ARGS"],
        "compose": yaml.safe_load(compose_config(CACHEMGR_TOKEN="t").stdout)["services"]["sglang"][
            "environment"
        ]["SGLANG_ARGS"],
        "systemd": systemd_env(SYSTEMD / "sglang.env")["SGLANG_ARGS"],
    }
    ids = set()
    for form, args in forms.items():
        mapped = args.replace("/srv/models/", "/models/").replace("/models/", f"{tmp_path}/models/")
        cmd = ["cachemgr", "--root", str(host.root), "init", "--print-env", "--instance", form]
        out = host.run(
            [
                *cmd,
                "--sglang-version",
                "0.5.19",
                "--",
                "python3",
                "-m",
                "sglang.launch_server",
                *mapped.split(),
            ],
            {},
        )
        ids.add(out.stdout.strip().rsplit("/", 1)[1])
    assert len(ids) == 1, forms
