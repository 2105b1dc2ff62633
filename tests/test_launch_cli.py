"""`init`, `exec` and `fingerprint` read a launch as its engine's parser does: an abbreviated
flag is its flag (the fp8 launch gets the fp8 namespace), and a flag the engine refuses is
refused before anything is made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.nsfixtures import cli, one_line_error
from tests.test_identity import make_model
from tests.test_init import CHILD, CMD, NO_STORAGE_ENV


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return make_model(tmp_path / "model")


def init_ns(root: Path, model: Path, *flags: str) -> dict[str, object]:
    launch = [*CMD.split(), "--model-path", str(model), *flags]
    out = cli("--root", str(root), "init", "--json", "--", *launch, env=NO_STORAGE_ENV)
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_init_with_an_abbreviated_kv_dtype_gets_the_fp8_namespace(root: Path, model: Path) -> None:
    bf16 = init_ns(root, model, "--kv-cache-dtype", "bfloat16")
    fp8 = init_ns(root, model, "--kv-cache-dtype", "fp8_e4m3")
    short = init_ns(root, model, "--kv-cache-dtyp", "fp8_e4m3")
    assert (short["outcome"], short["ns_id"]) == ("unchanged", fp8["ns_id"])
    assert short["ns_id"] != bf16["ns_id"]
    # SGLang's only --kv-cache-dt… flag: not ambiguous there, so it is the same namespace.
    assert init_ns(root, model, "--kv-cache-dt=fp8_e4m3")["ns_id"] == fp8["ns_id"]


def test_exec_with_an_abbreviated_kv_dtype_runs_in_the_fp8_namespace(
    root: Path, model: Path, tmp_path: Path
) -> None:
    fp8 = init_ns(root, model, "--page-size", "64", "--kv-cache-dtype", "fp8_e4m3")
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    server = [sys.executable, str(child), "--model-path", str(model), "--page-si", "64"]
    server += ["--enable-hierarchical-cache", "--hicache-storage-backend", "file"]
    server += ["--kv-cache-dtyp", "fp8_e4m3"]
    proc = subprocess.run(
        [sys.executable, "-m", "cachemgr", "--root", str(root), "exec", "--", *server],
        capture_output=True,
        text=True,
        env={**os.environ, **NO_STORAGE_ENV},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split(" ", 1)[0] == fp8["storage_dir"]
    assert "identity unchanged" in proc.stderr


def test_an_abbreviated_page_size_is_recorded(tmp_path: Path, model: Path) -> None:
    launch = ["sglang", "serve", "--model-path", str(model), "--page-si", "32"]
    out = cli("--root", str(tmp_path / "r"), "fingerprint", "--json", "--", *launch)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["page_size"] == 32


@pytest.mark.parametrize("command", ["init", "exec", "fingerprint"])
@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--totally-bogus", "3"], "unknown flag --totally-bogus: SGLang 0.5.23 has no such"),
        (["--enable-hi"], "ambiguous flag --enable-hi: SGLang 0.5.23 could read it as"),
    ],
)
def test_a_flag_sglang_refuses_is_one_line_exit_2_and_nothing_is_made(
    tmp_path: Path, model: Path, command: str, flags: list[str], says: str
) -> None:
    root = tmp_path / "fresh"
    program = [sys.executable, str(tmp_path / "server.py")]  # exec checks that it exists
    launch = [*program, "--model-path", str(model), "--page-size", "64", *flags]
    out = cli("--root", str(root), command, "--", *launch, env=NO_STORAGE_ENV)
    assert out.returncode == 2 and says in one_line_error(out), out.stderr
    assert not root.exists()


@pytest.mark.parametrize("command", ["init", "exec", "fingerprint"])
def test_a_flag_vllm_refuses_is_one_line_exit_2_and_nothing_is_made(
    tmp_path: Path, model: Path, command: str
) -> None:
    root = tmp_path / "fresh"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "vllm").write_text("#!/bin/sh\n")  # exec checks that it exists
    (bindir / "vllm").chmod(0o755)
    launch = ["vllm", "serve", str(model), "--kv-cache-dtyp", "fp8"]
    path = f"{bindir}:{os.environ['PATH']}"
    out = cli("--root", str(root), command, "--", *launch, env={"PATH": path})
    says = "ambiguous flag --kv-cache-dtyp: vLLM 0.34.0 could read it as --kv-cache-dtype, "
    assert out.returncode == 2 and says in one_line_error(out), out.stderr
    assert not root.exists()
