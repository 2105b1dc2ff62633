"""The "SGLang is not installed here" warning: once per root on stderr, always in --json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.nsfixtures import cli
from tests.test_identity import make_model
from tests.test_init import CMD, NO_STORAGE_ENV, run_exec

MISSING = "SGLang is not installed here"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return make_model(tmp_path / "model")


def _init(root: Path, model: Path, instance: str, *extra: str) -> tuple[str, str]:
    """`init` where SGLang is not installed (this venv has none); stdout and stderr."""
    launch = [*CMD.split(), "--model-path", str(model)]
    out = cli("--root", str(root), "init", "--instance", instance, *extra, "--", *launch,
              env=NO_STORAGE_ENV)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout, out.stderr


def _said(stderr: str) -> int:
    return sum(MISSING in line for line in stderr.splitlines())


def test_sglang_missing_is_said_once_per_root(tmp_path: Path, model: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    assert _said(_init(first, model, "a")[1]) == 1
    # The next init and exec on the same root (another instance: its own identity) stay quiet.
    assert _said(_init(first, model, "b")[1]) == 0
    assert _said(_init(first, model, "a")[1]) == 0
    proc, _, err = run_exec(first, model, tmp_path, {})
    assert proc.returncode == 0 and _said(err) == 0, err
    # Another root has not heard it yet.
    proc, _, err = run_exec(second, model, tmp_path, {})
    assert proc.returncode == 0 and _said(err) == 1, err


def test_json_warnings_carry_it_every_time(tmp_path: Path, model: Path) -> None:
    root = tmp_path / "root"
    for run in range(2):
        stdout, stderr = _init(root, model, "a", "--json")
        warnings = json.loads(stdout)["warnings"]
        assert [w for w in warnings if MISSING in w] and "--sglang-version" in warnings[0]
        assert _said(stderr) == (1 if run == 0 else 0), stderr
