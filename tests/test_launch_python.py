"""The engine's version from the launch's own interpreter: the python of `python -m …`, or
the one an entry point's shebang names; asked once per interpreter (and per install in it),
kept in the root's digest cache."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from cachemgr.identity.launchpython import LaunchPython, installed_version, launch_python
from tests.conftest import SGLANG_ENV, VLLM_ENV
from tests.nsfixtures import cli
from tests.test_identity import make_model
from tests.test_init import CMD, NO_STORAGE_ENV
from tests.vllm_launch import launch as vllm_launch

OLD = time.time() - 3600  # older than the digest cache's racy window


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return make_model(tmp_path / "model")


def fake_venv(where: Path, dist: str, version: str) -> Path:
    """A venv-like dir: bin/python runs this Python with a site dir holding only `dist`'s
    metadata, and counts its runs in bin/calls; bin/<dist> is an entry point naming it."""
    site = where / "site"
    (site / f"{dist}-{version}.dist-info").mkdir(parents=True)
    (site / f"{dist}-{version}.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
    )
    python = where / "bin" / "python"
    python.parent.mkdir()
    python.write_text(
        f'#!/bin/sh\necho run >> "{where}/bin/calls"\n'
        f'PYTHONPATH="{site}" exec "{sys.executable}" -S "$@"\n'
    )
    python.chmod(0o755)
    os.utime(python, (OLD, OLD))
    entry = where / "bin" / dist
    entry.write_text(f"#!{python}\nimport sys\n")
    entry.chmod(0o755)
    return python


def calls(python: Path) -> int:
    counter = python.parent / "calls"
    return len(counter.read_text().splitlines()) if counter.exists() else 0


def version_from(out_json: str) -> tuple[str | None, str]:
    source = json.loads(out_json)["source"]
    return source["sglang_version"], source["sglang_version_from"]


def test_python_m_in_another_venv_gives_its_version(tmp_path: Path, model: Path) -> None:
    python = fake_venv(tmp_path / "venv", "sglang", "0.7.1")
    launch = [str(python), "-m", "sglang.launch_server", "--model-path", str(model)]
    out = cli("--root", str(tmp_path / "r"), "fingerprint", "--json", "--", *launch)
    assert out.returncode == 0, out.stderr
    assert version_from(out.stdout) == ("0.7.1", "installed")
    assert "not installed here" not in out.stderr


def test_an_entry_points_shebang_names_the_python(tmp_path: Path, model: Path) -> None:
    python = fake_venv(tmp_path / "venv", "sglang", "0.7.2")
    path = f"{python.parent}:{os.environ['PATH']}"
    launch = ["env", "A=1", "sglang", "serve", "--model-path", str(model)]
    root = str(tmp_path / "r")
    out = cli("--root", root, "fingerprint", "--json", "--", *launch, env={"PATH": path})
    assert out.returncode == 0, out.stderr
    assert version_from(out.stdout) == ("0.7.2", "installed")


def test_the_version_is_asked_once_per_install(tmp_path: Path, model: Path) -> None:
    python = fake_venv(tmp_path / "venv", "sglang", "0.7.1")
    root = tmp_path / "r"
    launch = [str(python), "-m", "sglang.launch_server", *CMD.split()[2:]]
    launch += ["--model-path", str(model)]

    def init() -> tuple[str, str]:
        out = cli("--root", str(root), "init", "--json", "--", *launch, env=NO_STORAGE_ENV)
        assert out.returncode == 0, out.stderr
        return str(json.loads(out.stdout)["outcome"]), str(json.loads(out.stdout)["ns_id"])

    first = init()
    assert init() == ("unchanged", first[1]) and calls(python) == 1
    # A pip upgrade inside the venv: the interpreter is the same file, its site dir is not.
    site = tmp_path / "venv" / "site"
    shutil.rmtree(site / "sglang-0.7.1.dist-info")
    (site / "sglang-0.8.0.dist-info").mkdir()
    (site / "sglang-0.8.0.dist-info" / "METADATA").write_text("Name: sglang\nVersion: 0.8.0\n")
    outcome, ns = init()
    assert calls(python) == 2 and ns != first[1] and outcome != "unchanged"


def test_a_python_without_the_engine_falls_back_and_warns(tmp_path: Path, model: Path) -> None:
    python = fake_venv(tmp_path / "venv", "somethingelse", "1.0")
    launch = [str(python), "-m", "sglang.launch_server", "--model-path", str(model)]
    out = cli("--root", str(tmp_path / "r"), "fingerprint", "--json", "--", *launch)
    assert version_from(out.stdout) == (None, "unknown")
    assert "SGLang is not installed here" in out.stderr


@pytest.mark.parametrize(
    ("first_lines", "names"),
    [
        ("#!/usr/bin/env python3\n", "python3"),
        ("#!/usr/bin/env -S python3 -u\n", "python3"),
        ("#!/usr/bin/env -S PYTHONUNBUFFERED=1 python3 -u\n", "python3"),  # env sets it
        (
            "#!/bin/sh\n'''exec' /long/venv/bin/python \"$0\" \"$@\"\n' '''\n",
            "/long/venv/bin/python",
        ),
        ("#!/bin/sh\necho hi\n", None),
        ("no shebang\n", None),
    ],
)
def test_shebang_forms(tmp_path: Path, first_lines: str, names: str | None) -> None:
    entry = tmp_path / "sglang"
    entry.write_text(first_lines)
    entry.chmod(0o755)
    found = launch_python([str(entry), "serve"], {"PATH": os.environ["PATH"]})
    if names is None:
        assert found is None
    elif names.startswith("/"):
        assert found is not None and str(found.path) == names
    else:
        assert found is not None and found.path == Path(shutil.which(names) or "")


def test_no_program_or_a_missing_one_is_none(tmp_path: Path) -> None:
    assert launch_python([], {}) is None
    assert launch_python(["env", "A=1"], {}) is None
    assert launch_python(["no-such-program-xyz"], {"PATH": str(tmp_path)}) is None
    missing = LaunchPython(tmp_path / "python", {})
    assert installed_version(missing, "sglang") is None


@pytest.mark.sglang
def test_explain_shows_sglangs_real_version_from_its_venv(tmp_path: Path, model: Path) -> None:
    for program in (["python", "-m", "sglang.launch_server"], ["sglang", "serve"]):
        launch = [str(SGLANG_ENV / "bin" / program[0]), *program[1:]]
        launch += ["--model-path", str(model)]
        out = cli("--root", str(tmp_path / "r"), "fingerprint", "--explain", "--", *launch)
        assert out.returncode == 0, out.stderr
        assert "0.5.23 (installed)" in out.stdout, out.stdout


@pytest.mark.vllm
def test_explain_shows_vllms_real_version_from_its_venv(tmp_path: Path, model: Path) -> None:
    entry = vllm_launch(model)
    entry[0] = str(VLLM_ENV / "bin" / "vllm")
    module = [
        str(VLLM_ENV / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        *entry[2:],
    ]
    (dist,) = VLLM_ENV.glob("lib/python*/site-packages/vllm-*.dist-info")
    version = dist.name.removeprefix("vllm-").removesuffix(".dist-info")
    for launch in (entry, module):
        out = cli("--root", str(tmp_path / "r"), "fingerprint", "--explain", "--", *launch)
        assert out.returncode == 0, out.stderr
        assert f"{version} (installed)" in out.stdout, out.stdout
