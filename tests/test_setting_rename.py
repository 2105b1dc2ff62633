"""`engine_version_granularity` governs SGLang's and vLLM's version alike; its old name,
`sglang_version_granularity`, is still read from every source, with one deprecation line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cachemgr.settings import load_settings, unknown_env_vars

DEPRECATED = "is deprecated: use "


def config(*args: str, env: dict[str, str] | None = None) -> tuple[dict[str, object], list[str]]:
    """`cachemgr config --json` as a process: its JSON and its stderr lines."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CACHEMGR_")}
    done = subprocess.run(
        [sys.executable, "-m", "cachemgr", *args, "config", "--json"],
        capture_output=True,
        text=True,
        env={**clean, **(env or {})},
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout), done.stderr.splitlines()


def granularity(shown: dict[str, object]) -> tuple[object, object]:
    settings, sources = shown["settings"], shown["sources"]
    assert isinstance(settings, dict) and isinstance(sources, dict)
    assert "sglang_version_granularity" not in settings
    return settings["engine_version_granularity"], sources["engine_version_granularity"]


def test_the_old_env_var_sets_the_new_setting_with_one_line(tmp_path: Path) -> None:
    shown, err = config(
        "--root", str(tmp_path), env={"CACHEMGR_SGLANG_VERSION_GRANULARITY": "full"}
    )
    assert granularity(shown) == ("full", "env")
    assert err == [
        "environment variable CACHEMGR_SGLANG_VERSION_GRANULARITY is deprecated: use "
        "CACHEMGR_ENGINE_VERSION_GRANULARITY"
    ]
    assert unknown_env_vars({"CACHEMGR_SGLANG_VERSION_GRANULARITY": "full"}) == []


def test_the_new_env_var_wins_over_the_old_one(tmp_path: Path) -> None:
    old_and_new = {
        "CACHEMGR_SGLANG_VERSION_GRANULARITY": "full",
        "CACHEMGR_ENGINE_VERSION_GRANULARITY": "none",
    }
    shown, _ = config("--root", str(tmp_path), env=old_and_new)
    assert granularity(shown) == ("none", "env")


def test_the_old_toml_key_sets_the_new_setting_with_one_line(tmp_path: Path) -> None:
    toml = tmp_path / "cachemgr.toml"
    toml.write_text('sglang_version_granularity = "none"\n')
    shown, err = config("--root", str(tmp_path), "--config", str(toml))
    assert granularity(shown) == ("none", "file")
    assert [line for line in err if DEPRECATED in line] == [
        "setting sglang_version_granularity is deprecated: use engine_version_granularity"
    ]
    assert len(err) == 1


def test_the_old_keyword_is_read_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    from cachemgr import settings

    settings._warned.clear()  # once per process: this test's process may have said it
    assert load_settings(sglang_version_granularity="full").engine_version_granularity == "full"
    assert load_settings(sglang_version_granularity="none").engine_version_granularity == "none"
    lines = [r.getMessage() for r in caplog.records if DEPRECATED in r.getMessage()]
    assert lines == [
        "setting sglang_version_granularity is deprecated: use engine_version_granularity"
    ]


def _model(tmp_path: Path) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    path = tmp_path / "tiny"
    path.mkdir()
    save_file({"w": np.zeros((4, 4), np.float32)}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    return path


@pytest.mark.parametrize("flag", ["--engine-version-granularity", "--sglang-version-granularity"])
def test_either_flag_sets_how_much_of_the_version_counts(tmp_path: Path, flag: str) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CACHEMGR_")}
    argv = ["fingerprint", flag, "full", "--model-path", str(_model(tmp_path))]
    argv += ["--sglang-version", "0.5.23", "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "cachemgr", "--root", str(tmp_path / "root"), *argv],
        capture_output=True,
        text=True,
        env=clean,
        timeout=120,
        check=True,
    )
    assert json.loads(done.stdout)["sglang_version"] == "0.5.23"  # major.minor would be 0.5
    said = [line for line in done.stderr.splitlines() if DEPRECATED in line]
    old = flag == "--sglang-version-granularity"
    assert said == (
        ["flag --sglang-version-granularity is deprecated: use --engine-version-granularity"]
        if old
        else []
    )
