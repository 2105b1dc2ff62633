"""The "SGLang is not installed here" warning: an 'unknown' version is said every time it
enters an identity, on stderr and in --json; a version borrowed from the instance's namespace
is said once per root."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.nsfixtures import cli, cli_process
from tests.test_identity import make_model
from tests.test_init import CMD, NO_STORAGE_ENV, fake_installed_sglang, run_exec

MISSING = "SGLang is not installed here"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return make_model(tmp_path / "model")


def _init(root: Path, model: Path, instance: str, *extra: str) -> tuple[str, str]:
    """`init` where SGLang is not installed (this venv has none); stdout and stderr."""
    launch = [*CMD.split(), "--model-path", str(model)]
    out = cli(
        "--root",
        str(root),
        "init",
        "--instance",
        instance,
        *extra,
        "--",
        *launch,
        env=NO_STORAGE_ENV,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout, out.stderr


def _said(stderr: str) -> int:
    return sum(MISSING in line for line in stderr.splitlines())


def test_an_unknown_version_is_said_every_time(tmp_path: Path, model: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    assert _said(_init(first, model, "a")[1]) == 1
    # The next init and exec on the same root say it again: each identity has it.
    assert _said(_init(first, model, "b")[1]) == 1
    assert _said(_init(first, model, "a")[1]) == 1
    proc, _, err = run_exec(first, model, tmp_path, {})
    assert proc.returncode == 0 and _said(err) == 1, err
    proc, _, err = run_exec(second, model, tmp_path, {})
    assert proc.returncode == 0 and _said(err) == 1, err
    launch = [*CMD.split(), "--model-path", str(model)]
    for _ in range(2):
        out = cli("--root", str(first), "fingerprint", "--", *launch)
        assert out.returncode == 0 and _said(out.stderr) == 1, out.stderr


def test_a_borrowed_version_is_said_once_per_root(tmp_path: Path, model: Path) -> None:
    root = tmp_path / "root"
    launch = [*CMD.split(), "--model-path", str(model)]
    installed = fake_installed_sglang(tmp_path / "site", "0.5.23")
    made = cli_process("--root", str(root), "init", "--", *launch, env=installed)
    assert made.returncode == 0, made.stderr
    borrowed = "using version 0.5 of the instance's namespace"
    said = [borrowed in _init(root, model, "default")[1] for _ in range(2)]
    assert said == [True, False]


def test_json_warnings_carry_it_every_time(tmp_path: Path, model: Path) -> None:
    root = tmp_path / "root"
    for _ in range(2):
        stdout, stderr = _init(root, model, "a", "--json")
        warnings = json.loads(stdout)["warnings"]
        assert [w for w in warnings if MISSING in w] and "--sglang-version" in warnings[0]
        assert _said(stderr) == 1, stderr


NO_PAGE = "SGLang will write no page to"


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ([], "--enable-hierarchical-cache is missing"),
        (["--enable-hierarchical-cache"], "--hicache-storage-backend is none"),
        (["--enable-hierarchical-cache", "--hicache-storage-backend", "nixl"], "is nixl"),
    ],
)
def test_a_launch_that_writes_no_page_is_said_by_init(
    tmp_path: Path, model: Path, flags: list[str], says: str
) -> None:
    root = tmp_path / "root"
    launch = ["sglang", "serve", "--model-path", str(model), "--page-size", "64", *flags]
    out = cli("--root", str(root), "init", "--json", "--", *launch, env=NO_STORAGE_ENV)
    assert out.returncode == 0, out.stderr
    made = json.loads(out.stdout)
    (warning,) = [w for w in made["warnings"] if NO_PAGE in w]
    assert says in warning and str(root / "ns" / made["ns_id"]) in warning
    assert f"cachemgr: warning: {warning}" in out.stderr.splitlines()


def test_a_launch_with_the_file_backend_is_not_warned(tmp_path: Path, model: Path) -> None:
    stdout, stderr = _init(tmp_path / "root", model, "a", "--json")
    assert not [w for w in json.loads(stdout)["warnings"] if NO_PAGE in w]
    assert NO_PAGE not in stderr


def test_exec_says_it_too(tmp_path: Path, model: Path) -> None:
    proc, _, err = run_exec(tmp_path / "root", model, tmp_path, {})  # (no hierarchical cache)
    assert proc.returncode == 0 and NO_PAGE in err and "is missing" in err, err


def test_a_pd_decode_server_offloading_through_the_file_backend_is_not_warned(
    tmp_path: Path, model: Path
) -> None:
    # SGLang's decode server offloads through the storage backend without hierarchical cache.
    decode = ["--disaggregation-mode", "decode", "--hicache-storage-backend", "file"]
    base = ["sglang", "serve", "--model-path", str(model), "--page-size", "64", *decode]
    for offload, warned in (
        ([], True),
        (["--disaggregation-decode-enable-offload-kvcache"], False),
    ):
        out = cli("--root", str(tmp_path / "r"), "init", "--", *base, *offload, env=NO_STORAGE_ENV)
        assert out.returncode == 0 and (NO_PAGE in out.stderr) == warned, out.stderr


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--enable-lmcache"], "--enable-lmcache replaces the radix cache"),
        (["--enable-flexkv"], "FlexKV"),
        (["--radix-cache-backend", "flexkv"], "FlexKV"),
        (["--dllm-algorithm", "LowConfidence"], "--dllm-algorithm LowConfidence turns"),
    ],
)
def test_a_cache_that_replaces_sglangs_hierarchical_cache_is_said(
    tmp_path: Path, model: Path, flags: list[str], says: str
) -> None:
    launch = [*CMD.split(), "--model-path", str(model), *flags]
    out = cli("--root", str(tmp_path / "r"), "init", "--", *launch, env=NO_STORAGE_ENV)
    assert out.returncode == 0 and says in out.stderr and NO_PAGE in out.stderr, out.stderr
