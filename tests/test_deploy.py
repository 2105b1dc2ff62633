"""deploy/: the compose file, the systemd units and the sample config, checked by real tools."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from cachemgr.daemon.connections import ConnectionBudget
from cachemgr.daemon.serving import LISTEN_BACKLOG
from cachemgr.settings import Settings, load_settings

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
SYSTEMD = DEPLOY / "systemd"
LAUNCH = "python3 -m sglang.launch_server $SGLANG_ARGS"


def compose_client() -> list[str] | None:
    """`docker compose` (v2 plugin) or Debian's `docker-compose` (v1), whichever exists."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def compose_config(path: Path = COMPOSE, **env: str) -> subprocess.CompletedProcess[str]:
    """`compose config` with exactly these deploy variables set (none from the caller's env)."""
    client = compose_client()
    assert client, "no compose client: scripts/test-deps.sh installs Debian's docker-compose"
    base = {k: v for k, v in os.environ.items() if k not in {"CACHEMGR_TOKEN", "MODELS_DIR"}}
    return subprocess.run(
        [*client, "-f", str(path), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **env},
    )


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The compose file as the real client resolves it (anchors merged, variables set)."""
    out = compose_config(CACHEMGR_TOKEN="test-token", MODELS_DIR="/srv/models")
    assert out.returncode == 0, out.stderr
    resolved: dict[str, Any] = yaml.safe_load(out.stdout)
    return resolved


def test_compose_refuses_to_start_without_a_token() -> None:
    out = compose_config(MODELS_DIR="/srv/models")
    assert out.returncode != 0
    assert "CACHEMGR_TOKEN" in out.stderr


def test_compose_runs_init_before_the_daemon_and_the_server(compose: dict[str, Any]) -> None:
    svc = compose["services"]
    assert set(svc) == {"cachemgr-init", "cachemgr", "sglang", "prometheus"}
    done = {"condition": "service_completed_successfully"}
    assert svc["cachemgr"]["depends_on"]["cachemgr-init"] == done
    assert svc["sglang"]["depends_on"]["cachemgr-init"] == done
    assert svc["sglang"]["depends_on"]["cachemgr"] == {"condition": "service_healthy"}
    init_cmd = " ".join(svc["cachemgr-init"]["entrypoint"] + svc["cachemgr-init"]["command"])
    server_cmd = " ".join(svc["sglang"]["entrypoint"] + svc["sglang"]["command"])
    # Compose escapes $ as $$; the shell in the container sees $SGLANG_ARGS.
    assert "cachemgr init" in init_cmd and "--env-file /run/cachemgr/env" in init_cmd
    assert init_cmd.replace("$$", "$").endswith(f'--sglang-version "$SGLANG_VERSION" -- {LAUNCH}')
    assert server_cmd.replace("$$", "$").endswith(f"exec {LAUNCH}")
    assert ". /run/cachemgr/env" in server_cmd
    args = {s: svc[s]["environment"]["SGLANG_ARGS"] for s in ("cachemgr-init", "sglang")}
    assert args["cachemgr-init"] == args["sglang"] and "--page-size 64" in args["sglang"]
    version = svc["cachemgr-init"]["environment"]["SGLANG_VERSION"]
    assert svc["sglang"]["image"] == f"lmsysorg/sglang:v{version}-cu129"


def full_cap_fits(soft: int, hard: int) -> bool:
    """True if a daemon under these nofile limits gets the default connection cap, with the
    reserve free and room to spare for what it holds open at start (100 fds: ~15 measured)."""
    fields = Settings.model_fields
    wanted = fields["http_max_connections"].default
    reserve = fields["http_fd_reserve"].default
    budget = ConnectionBudget(hard, 100, reserve, LISTEN_BACKLOG, wanted)
    return soft == hard and budget.cap == wanted


def test_compose_gives_the_daemon_open_files_for_its_connection_cap(
    compose: dict[str, Any],
) -> None:
    nofile = compose["services"]["cachemgr"]["ulimits"]["nofile"]
    assert full_cap_fits(int(nofile["soft"]), int(nofile["hard"])), nofile


def test_compose_shares_the_cache_volume_and_reserves_a_gpu(compose: dict[str, Any]) -> None:
    svc = compose["services"]
    for name in ("cachemgr-init", "cachemgr", "sglang"):
        assert any(v.startswith("hicache:/var/cache/hicache") for v in svc[name]["volumes"]), name
    assert "hicache" in compose["volumes"]
    (device,) = svc["sglang"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert svc["cachemgr"]["environment"]["CACHEMGR_TOKEN"] == "test-token"
    assert svc["cachemgr"]["read_only"] is True
    for volume in svc["prometheus"]["volumes"]:
        source = volume.split(":")[0]
        if source.startswith("/"):
            assert Path(source).exists(), f"prometheus mounts a missing {source}"


def systemd_tree(tmp_path: Path) -> tuple[Path, dict[str, Path]]:
    """The units copied to a temp dir, their absolute binaries pointed at stubs there."""
    stubs = {
        "/opt/cachemgr/bin/cachemgr": tmp_path / "bin" / "cachemgr",
        "/opt/sglang/bin/python3": tmp_path / "bin" / "python3",
    }
    for stub in stubs.values():
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text("#!/bin/sh\n")
        stub.chmod(0o755)
    units = tmp_path / "units"
    shutil.copytree(SYSTEMD, units)
    for f in units.rglob("*"):
        if f.is_file():
            text = f.read_text()
            for real, stub in stubs.items():
                text = text.replace(real, str(stub))
            f.write_text(text)
    return units, stubs


def verify(*units: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *map(str, units)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0"},
    )


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    units, stubs = systemd_tree(tmp_path)
    out = verify(units / "cachemgr.service", units / "sglang.service")
    assert out.returncode == 0 and out.stdout + out.stderr == "", out.stderr
    # The drop-in is really read with sglang.service: without cachemgr, its ExecStartPre fails.
    stubs["/opt/cachemgr/bin/cachemgr"].unlink()
    out = verify(units / "sglang.service")
    assert out.returncode != 0 and "cachemgr is not executable" in out.stderr


def env_lines(path: Path) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]


def unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text())
    return parser


def test_daemon_unit_is_hardened_around_the_cache_root() -> None:
    svc = unit(SYSTEMD / "cachemgr.service")["Service"]
    root = load_settings(DEPLOY / "cachemgr.toml").root
    assert svc["ReadWritePaths"] == str(root)
    assert svc["ProtectSystem"] == "strict" and svc["ProtectHome"] == "yes"
    assert svc["NoNewPrivileges"] == "yes" and svc["PrivateTmp"] == "yes"
    assert svc["User"] == "cachemgr" and svc["Restart"] == "on-failure"
    assert svc["ExecStart"].endswith("cachemgr serve")
    assert svc["Environment"] == "CACHEMGR_CONFIG=/etc/cachemgr/cachemgr.toml"


def test_daemon_unit_gives_open_files_for_the_connection_cap() -> None:
    limit = int(unit(SYSTEMD / "cachemgr.service")["Service"]["LimitNOFILE"])  # soft = hard
    assert full_cap_fits(limit, limit)


def test_dropin_inits_the_exact_command_the_unit_starts() -> None:
    start = unit(SYSTEMD / "sglang.service")["Service"]["ExecStart"]
    dropin = unit(SYSTEMD / "sglang.service.d" / "cachemgr.conf")["Service"]
    pre = dropin["ExecStartPre"]
    init, _, command = pre.partition(" -- ")
    assert command == start and start.endswith(LAUNCH)
    assert init.endswith("--sglang-version ${SGLANG_VERSION}")
    env = dict(line.split("=", 1) for line in env_lines(SYSTEMD / "sglang.env"))
    assert set(env) == {"SGLANG_ARGS", "SGLANG_VERSION"} and "--page-size 64" in env["SGLANG_ARGS"]
    env_file = init.split("--env-file ")[1].split()[0]
    assert dropin["EnvironmentFile"] == f"-{env_file}"  # "-": absent while ExecStartPre runs
    assert env_file.startswith(f"/run/{dropin['RuntimeDirectory']}/")


def test_sample_config_loads_and_names_only_real_settings(tmp_path: Path) -> None:
    settings = load_settings(DEPLOY / "cachemgr.toml")
    assert settings.root == Path("/var/cache/sglang-hicache")
    assert settings.host == "127.0.0.1"  # loopback: no token needed on a host install
    # Every commented "# key = value" line is a real setting shown with its default.
    text = (DEPLOY / "cachemgr.toml").read_text()
    commented = re.findall(r"^# (\w+) = ", text, re.M)
    assert len(commented) >= 5
    (tmp_path / "all.toml").write_text(re.sub(r"^# (\w+ = )", r"\1", text, flags=re.M))
    uncommented = load_settings(tmp_path / "all.toml")
    defaults = load_settings(root=settings.root)
    for key in commented:
        # Settings without a default (None: a cap, <root>/.cachemgr) are shown with an example.
        if Settings.model_fields[key].default is not None:
            assert getattr(uncommented, key) == getattr(defaults, key), key


def test_sample_config_lists_every_setting() -> None:
    """docs/deploy.md says every setting is in deploy/cachemgr.toml: one added to the Settings
    model must be added there (set, or commented with its default or an example)."""
    text = (DEPLOY / "cachemgr.toml").read_text()
    listed = set(re.findall(r"^(?:# )?(\w+) = ", text, re.M))
    assert set(Settings.model_fields) - listed == set()


def test_every_cachemgr_variable_the_deployments_set_is_a_setting(
    compose: dict[str, Any],
) -> None:
    """CACHEMGR_* variables nobody reads are ignored silently: a renamed setting must fail here."""
    from cachemgr.settings import Settings
    from tests.test_deploy_kubernetes import KUSTOMIZE, pod_containers, render

    names = set()
    for doc in render(KUSTOMIZE):
        names |= {e["name"] for c in pod_containers(doc) for e in c.get("env", [])}
    names |= {k for svc in compose["services"].values() for k in svc.get("environment", {})}
    for path in (SYSTEMD / "cachemgr.service", SYSTEMD / "sglang.service.d" / "cachemgr.conf"):
        names.add(unit(path)["Service"]["Environment"].split("=")[0])
    image_env = re.findall(r"(CACHEMGR_\w+)=", (DEPLOY / "Dockerfile").read_text())
    ours = {n for n in names | set(image_env) if n.startswith("CACHEMGR_")}
    fields = {f"CACHEMGR_{f.upper()}" for f in Settings.model_fields} | {"CACHEMGR_CONFIG"}
    assert "CACHEMGR_INSTANCE" in ours and ours <= fields, sorted(ours - fields)
