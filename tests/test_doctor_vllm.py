"""`cachemgr doctor -- vllm serve …`: the fs-tier pitfalls, on real dirs through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.nsfixtures import cli
from tests.test_identity import make_model
from tests.vllm_launch import launch, tier_config, vinit_json

CAP = {"CACHEMGR_GC_MAX_BYTES": "50GB"}


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return make_model(tmp_path / "model")


def doctor(
    root: Path, command: list[str], env: dict[str, str] | None = None
) -> tuple[int, list[str], list[dict[str, str]]]:
    out = cli("--root", str(root), "doctor", "--json", "--", *command, env=env)
    findings = json.loads(out.stdout)
    return out.returncode, sorted(f["code"] for f in findings), findings


def vllm_folder(root_dir: Path, model_name: str, digest: str = "0123456789ab") -> None:
    """A folder as vLLM's fs tier makes one: <model>_<digest12>/config.json (model_name)."""
    folder = root_dir / f"{model_name.replace('/', '_')}_{digest}"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_name": model_name, "dtype": "bf16"}))


def test_an_uncapped_tier_outside_the_root_is_named(root: Path, model: Path) -> None:
    assert doctor(root, launch(model))[:2] == (1, ["fs-tier-uncapped", "unmanaged-root-dir"])
    assert doctor(root, launch(model), CAP)[:2] == (1, ["unmanaged-root-dir"])


def test_a_per_namespace_cap_is_a_cap(root: Path, model: Path) -> None:
    # The launch's namespace is capped: its tier does not fill the disk.
    ns_cap = {"CACHEMGR_GC_NAMESPACE_MAX_BYTES": "50GB"}
    assert doctor(root, launch(model), ns_cap)[:2] == (1, ["unmanaged-root-dir"])
    _, _, findings = doctor(root, launch(model))
    (uncapped,) = [f for f in findings if f["code"] == "fs-tier-uncapped"]
    assert "gc_namespace_max_bytes" in uncapped["message"]


def test_a_namespace_root_dir_of_this_identity_is_clean(root: Path, model: Path) -> None:
    result = vinit_json(root, launch(model))
    assert doctor(root, result["command"], CAP)[:2] == (0, [])


def test_the_launch_given_to_exec_is_not_unmanaged(root: Path, model: Path) -> None:
    # exec points the tier's root_dir at the launch's namespace: doctor on the same launch
    # lints that namespace once init or exec made it, not the root_dir the command names.
    assert doctor(root, launch(model), CAP)[:2] == (1, ["unmanaged-root-dir"])
    vinit_json(root, launch(model))
    code, codes, findings = doctor(root, launch(model), CAP)
    assert (code, codes) == (0, ["exec-namespace"])
    assert "started without it, it would use /srv/kv" in findings[0]["message"]


def test_a_root_dir_of_another_identity_is_an_error(root: Path, model: Path) -> None:
    result = vinit_json(root, launch(model, "--kv-cache-dtype", "fp8"))
    other = [*result["command"], "--kv-cache-dtype", "fp8_e5m2"]
    code, codes, findings = doctor(root, other, CAP)
    assert (code, codes) == (2, ["storage-identity-mismatch"])
    assert "kv_cache_dtype: fp8 → fp8_e5m2" in findings[0]["message"]


def test_a_root_dir_shared_by_two_models_servers_is_named(
    root: Path, model: Path, tmp_path: Path
) -> None:
    shared = tmp_path / "kv"
    vllm_folder(shared, str(model))  # this model's own folder does not count
    command = launch(model, config=tier_config(str(shared)))
    assert "root-dir-shared" not in doctor(root, command, CAP)[1]
    vllm_folder(shared, "Qwen/Qwen3-8B", "ba9876543210")
    code, codes, findings = doctor(root, command, CAP)
    assert (code, codes) == (1, ["root-dir-shared", "unmanaged-root-dir"])
    assert "Qwen/Qwen3-8B" in next(f for f in findings if f["code"] == "root-dir-shared")["message"]
    # A symlinked folder or a config.json that is not vLLM's is not read as another model.
    (shared / "Qwen_Qwen3-8B_ba9876543210" / "config.json").write_text("{partial")
    vllm_folder(tmp_path / "elsewhere", "evil/model", "aaaaaaaaaaaa")
    (shared / "evil_model_aaaaaaaaaaaa").symlink_to(
        tmp_path / "elsewhere" / "evil_model_aaaaaaaaaaaa"
    )
    assert "root-dir-shared" not in doctor(root, command, CAP)[1]


def test_a_launch_without_an_fs_tier_says_so(root: Path, model: Path) -> None:
    assert doctor(root, ["vllm", "serve", str(model)], CAP)[:2] == (1, ["no-fs-tier"])


def test_a_bad_vllm_value_is_one_line_exit_2(root: Path, model: Path) -> None:
    out = cli("--root", str(root), "doctor", "--", *launch(model, "--kv-cache-dtype", "fp9"))
    assert out.returncode == 2 and "invalid --kv-cache-dtype 'fp9'" in out.stderr
