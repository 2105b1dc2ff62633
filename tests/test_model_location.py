"""A repo id's weights are fingerprinted from the cache the server loads them from: its
--download-dir, else the hub cache its environment names, the launch's own `env VAR=…`
prefix included — never just the environment cachemgr itself runs in."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from cachemgr.errors import ModelNotFoundError
from cachemgr.identity.fingerprint import IdentityOptions
from cachemgr.identity.model_dir import hf_hub_cache
from cachemgr.identity.record import Digested
from cachemgr.sglang.args import resolve_launch_args
from cachemgr.sglang.identity import compute_identity
from cachemgr.vllm.args import resolve_vllm_args
from cachemgr.vllm.identity import compute_vllm_identity
from tests.conftest import ScriptRunner
from tests.test_identity import make_model
from tests.vllm_launch import launch as vllm_launch

COMMIT = "abc123"


def hub_with(hub: Path, repo: str, seed: int) -> Path:
    """An HF hub cache holding `repo` at refs/main, with weights of its own (`seed`)."""
    entry = hub / ("models--" + repo.replace("/", "--"))
    snapshot = make_model(entry / "snapshots" / COMMIT, seed=seed)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def hubs(tmp_path: Path) -> tuple[Path, Path]:
    """Two hub caches with different weights under the same repo id."""
    first, second = tmp_path / "hf_c1", tmp_path / "hf_c2"
    hub_with(first, "org/tiny", seed=1)
    hub_with(second, "org/tiny", seed=2)
    return first, second


def sglang(command: str, env: dict[str, str]) -> Digested:
    opts = IdentityOptions(engine_version="0.5.23")
    return compute_identity(resolve_launch_args(command), opts, env=env)


def vllm(command: list[str], env: dict[str, str]) -> Digested:
    opts = IdentityOptions(engine_version="0.34.0")
    return compute_vllm_identity(resolve_vllm_args(command, env), opts, env=env)


def test_sglang_download_dir_is_the_cache_its_weights_come_from(hubs: tuple[Path, Path]) -> None:
    first, second = hubs
    env = {"HF_HUB_CACHE": str(first)}
    plain = sglang("sglang serve --model-path org/tiny --page-size 64", env)
    moved = sglang(
        f"sglang serve --model-path org/tiny --page-size 64 --download-dir {second}", env
    )
    assert plain.source.model_dir.startswith(str(first))  # no flag: the environment's cache
    assert moved.source.model_dir.startswith(str(second))
    assert moved.ns_id != plain.ns_id
    assert (
        moved.ns_id
        == sglang("--model-path org/tiny --page-size 64", {"HF_HUB_CACHE": str(second)}).ns_id
    )


def test_sglang_launch_env_prefix_names_the_cache(hubs: tuple[Path, Path], tmp_path: Path) -> None:
    first, second = hubs
    env = {"HF_HUB_CACHE": str(first)}
    plain = sglang("sglang serve --model-path org/tiny", env)
    prefixed = sglang(f"env HF_HUB_CACHE={second} sglang serve --model-path org/tiny", env)
    assert prefixed.source.model_dir.startswith(str(second))
    assert prefixed.ns_id != plain.ns_id
    # HF_HOME in the prefix beats the HF_HOME cachemgr runs with (HF_HUB_CACHE unset)
    home = tmp_path / "home"
    hub_with(home / "hub", "org/tiny", seed=2)
    by_home = sglang(f"HF_HOME={home} python -m sglang.launch_server --model-path org/tiny", {})
    assert by_home.source.model_dir.startswith(str(home / "hub"))
    # an unrelated variable in the prefix changes nothing
    other = sglang("env CUDA_VISIBLE_DEVICES=1 sglang serve --model-path org/tiny", env)
    assert other.ns_id == plain.ns_id


def test_sglang_model_only_in_download_dir_is_found(tmp_path: Path) -> None:
    only = tmp_path / "dl"
    hub_with(only, "org/only", seed=3)
    env = {"HF_HUB_CACHE": str(tmp_path / "empty")}
    with pytest.raises(ModelNotFoundError):
        sglang("--model-path org/only", env)
    found = sglang(f"--model-path org/only --download-dir {only}", env)
    assert found.source.model_dir.startswith(str(only))


def test_sglang_draft_model_comes_from_the_download_dir(hubs: tuple[Path, Path]) -> None:
    first, second = hubs
    env = {"HF_HUB_CACHE": str(first)}
    target = make_model(second.parent / "target", seed=9)
    draft = f"--model-path {target} --speculative-draft-model-path org/tiny"
    plain = sglang(draft, env)
    moved = sglang(f"{draft} --download-dir {second}", env)
    assert moved.source.draft_model_dir is not None
    assert moved.source.draft_model_dir.startswith(str(second))
    assert moved.ns_id != plain.ns_id


def test_vllm_launch_env_prefix_names_the_cache(hubs: tuple[Path, Path]) -> None:
    first, second = hubs
    env = {"HF_HUB_CACHE": str(first)}
    plain = vllm(vllm_launch("org/tiny"), env)
    prefixed = vllm(["env", f"HF_HUB_CACHE={second}", *vllm_launch("org/tiny")], env)
    by_flag = vllm(vllm_launch("org/tiny", "--download-dir", str(second)), env)
    assert plain.source.model_dir.startswith(str(first))
    assert prefixed.source.model_dir.startswith(str(second))
    assert prefixed.ns_id == by_flag.ns_id != plain.ns_id


@pytest.mark.parametrize("value", ["1", "true", "True", "yes", "y"])
def test_sglang_on_modelscope_never_reads_the_hf_copy_of_the_id(
    hubs: tuple[Path, Path], tmp_path: Path, value: str
) -> None:
    """SGLang downloads a repo id from ModelScope then (environ.py's EnvBool): the HF cache's
    copy of the same id may be other weights, so it is refused, not fingerprinted."""
    first, _ = hubs
    env = {"HF_HUB_CACHE": str(first)}
    for launch, environ in (
        ("sglang serve --model-path org/tiny", {**env, "SGLANG_USE_MODELSCOPE": value}),
        (f"env SGLANG_USE_MODELSCOPE={value} sglang serve --model-path org/tiny", env),
    ):
        with pytest.raises(ModelNotFoundError, match="SGLANG_USE_MODELSCOPE is set"):
            sglang(launch, environ)
    # a draft given by id is refused the same way; a local directory is read as always
    target = make_model(tmp_path / "target", seed=9)
    on = {**env, "SGLANG_USE_MODELSCOPE": value}
    with pytest.raises(ModelNotFoundError, match="ModelScope"):
        sglang(f"--model-path {target} --speculative-draft-model-path org/tiny", on)
    assert sglang(f"--model-path {target}", on).ns_id == sglang(f"--model-path {target}", env).ns_id


@pytest.mark.parametrize("value", ["", "0", "false", "no"])
def test_sglang_modelscope_off_reads_the_hf_cache(hubs: tuple[Path, Path], value: str) -> None:
    first, _ = hubs
    env = {"HF_HUB_CACHE": str(first)}
    off = sglang("--model-path org/tiny", {**env, "SGLANG_USE_MODELSCOPE": value})
    assert off.source.model_dir.startswith(str(first))


def test_vllm_on_modelscope_never_reads_the_hf_copy_of_the_id(
    hubs: tuple[Path, Path], tmp_path: Path
) -> None:
    first, _ = hubs
    env = {"HF_HUB_CACHE": str(first)}
    for environ in ({**env, "VLLM_USE_MODELSCOPE": "True"}, {**env, "VLLM_USE_MODELSCOPE": " 1"}):
        with pytest.raises(ModelNotFoundError, match="VLLM_USE_MODELSCOPE is set"):
            vllm(vllm_launch("org/tiny"), environ)
    with pytest.raises(ModelNotFoundError, match="ModelScope"):
        vllm(["env", "VLLM_USE_MODELSCOPE=true", *vllm_launch("org/tiny")], env)
    # vLLM reads only 1 and true (envs.py); a local directory is read as always
    assert vllm(vllm_launch("org/tiny"), {**env, "VLLM_USE_MODELSCOPE": "yes"}).source.model_dir
    local = make_model(tmp_path / "local", seed=4)
    on = {**env, "VLLM_USE_MODELSCOPE": "1"}
    assert vllm(vllm_launch(str(local)), on).ns_id == vllm(vllm_launch(str(local)), env).ns_id


def test_an_empty_hub_variable_is_a_dir_not_unset(
    hubs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """huggingface_hub takes HF_HUB_CACHE="" as given: the server's working dir, not the
    legacy or default cache. cachemgr read it as unset and fingerprinted another cache's
    weights than the server loads."""
    first, second = hubs
    work = tmp_path / "work"
    hub_with(work, "org/tiny", seed=2)
    monkeypatch.chdir(work)  # (exec keeps cachemgr's working dir for the server)
    env = {"HUGGINGFACE_HUB_CACHE": str(first), "HF_HUB_CACHE": ""}
    got = vllm(vllm_launch("org/tiny"), env)
    assert got.source.model_dir.startswith(str(work))
    assert got.ns_id == vllm(vllm_launch("org/tiny"), {"HF_HUB_CACHE": str(second)}).ns_id
    home = {"HF_HOME": "$WHERE/home", "WHERE": str(tmp_path)}  # expanded, as hf does
    hub_with(tmp_path / "home" / "hub", "org/tiny", seed=3)
    assert vllm(vllm_launch("org/tiny"), home).source.model_dir.startswith(str(tmp_path))


HUB_CACHE = textwrap.dedent("""
    import importlib, json, os, sys
    import huggingface_hub.constants as constants
    asked = json.loads(sys.stdin.read())
    saved, cwd = dict(os.environ), os.getcwd()
    os.chdir(asked["cwd"])
    read = []
    for env in asked["cases"]:
        os.environ.clear()
        os.environ.update({"HOME": saved["HOME"], **env})
        read.append(os.path.abspath(importlib.reload(constants).HF_HUB_CACHE))
    os.environ.clear()
    os.environ.update(saved)
    os.chdir(cwd)
    importlib.reload(constants)
    print(json.dumps(read))
""")


@pytest.mark.vllm
def test_hub_cache_is_where_the_servers_huggingface_hub_looks(
    vllm_scripts: ScriptRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against the huggingface_hub of vLLM's env (constants.py): set but empty variables,
    the legacy name, `~` and `$VAR`s, relative paths."""
    cases = [
        {},
        {"HF_HUB_CACHE": ""},
        {"HF_HOME": ""},
        {"XDG_CACHE_HOME": ""},
        {"XDG_CACHE_HOME": "/x"},
        {"HUGGINGFACE_HUB_CACHE": "", "HF_HOME": "/h"},
        {"HF_HUB_CACHE": "", "HUGGINGFACE_HUB_CACHE": "/legacy"},
        {"HUGGINGFACE_HUB_CACHE": "$V/legacy", "V": "/srv"},
        {"HF_HOME": "$V/hf", "V": "/srv"},
        {"HF_HUB_CACHE": "${V}/hub", "V": "/srv"},
        {"HF_HOME": "$UNSET_HERE/hf"},
        {"HF_HOME": "~/hf"},
        {"HF_HUB_CACHE": "rel/hub"},
        {"HOME": "/srv/user"},  # the server's own HOME (a `HOME=…` prefix, another user)
        {"HOME": "/srv/user/", "HF_HOME": "~/hf"},
        {"HOME": "/", "HF_HUB_CACHE": "~"},
    ]
    asked = {"cwd": str(tmp_path), "cases": cases}
    theirs = json.loads(vllm_scripts.run(HUB_CACHE, stdin=json.dumps(asked)))
    monkeypatch.chdir(tmp_path)
    for env, their in zip(cases, theirs, strict=True):
        assert os.path.normpath(hf_hub_cache(env)) == their, env
