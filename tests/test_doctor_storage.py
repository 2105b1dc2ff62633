"""doctor compares the launch's identity with what the storage dir the server would use holds."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from tests.nsfixtures import cli, page_name
from tests.test_identity import make_model
from tests.test_init import CMD, fill, init_json

STORAGE_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return make_model(tmp_path / "model")


def launch(model: Path, kv: str, *extra: str) -> list[str]:
    return [*CMD.split(), "--model-path", str(model), "--kv-cache-dtype", kv, *extra]


def doctor(root: Path, command: list[str], storage: str = "") -> tuple[int, dict[str, Any]]:
    """(exit code, findings by code) of `cachemgr doctor --json -- command`."""
    env = {STORAGE_ENV: storage, "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE": ""}
    out = cli("--root", str(root), "doctor", "--json", "--", *command, env=env)
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, {f["code"]: f for f in json.loads(out.stdout)}


def test_a_bf16_dir_for_an_fp8_launch_is_an_error_naming_the_change(
    root: Path, model: Path
) -> None:
    bf16 = Path(str(init_json(root, model)["storage_dir"]))
    fill(bf16, 3)
    code, found = doctor(root, launch(model, "fp8_e4m3"), storage=str(bf16))
    assert code == 2
    finding = found["storage-identity-mismatch"]
    assert finding["severity"] == "error"
    assert finding["message"].startswith(
        f"storage dir {bf16} belongs to another identity (kv_cache_dtype: bfloat16 → fp8_e4m3) "
        "and holds 3 pages"
    )
    assert f"cachemgr --root {root} exec -- " in finding["fix"]
    # The same launch with its own identity: nothing to say about the dir.
    code, found = doctor(root, launch(model, "bfloat16"), storage=str(bf16))
    assert (code, list(found)) == (0, [])


def test_the_extra_configs_storage_path_is_the_dir_checked(root: Path, model: Path) -> None:
    bf16 = Path(str(init_json(root, model)["storage_dir"]))
    extra = json.dumps({"file_storage_path": str(bf16)})
    cmd = launch(model, "fp8_e4m3", "--hicache-storage-backend-extra-config", extra)
    code, found = doctor(root, cmd)
    assert (
        code == 2
        and "kv_cache_dtype: bfloat16 → fp8_e4m3" in (found["storage-identity-mismatch"]["message"])
    )


def test_a_plain_sglang_dir_with_pages_is_an_unknown_identity(
    root: Path, model: Path, tmp_path: Path
) -> None:
    plain = tmp_path / "hicache"
    plain.mkdir()
    for i in range(2):
        (plain / page_name(i)).write_bytes(b"k" * 10)
    cmd = launch(model, "fp8_e4m3", "--page-size", "64")
    code, found = doctor(root, cmd, storage=str(plain))
    assert code == 2
    finding = found["storage-unknown-identity"]
    assert finding["message"].startswith(f"storage dir {plain} has 2 pages and no manifest")
    assert "unknown identity" in finding["message"]
    assert finding["fix"].startswith(
        f"adopt it with `cachemgr --root {root} init -- {shlex.join(cmd)}` or purge it: "
    )
    assert f"find {plain} -maxdepth 1 -name '*.bin' -delete" in finding["fix"]
    # Empty, it holds nothing to be served: only the unmanaged-dir warning stays.
    for page in plain.iterdir():
        page.unlink()
    assert doctor(root, cmd, storage=str(plain))[1].keys() == {"unmanaged-dir"}


def test_a_namespace_dir_without_manifest_names_the_purge(root: Path, model: Path) -> None:
    ns = Path(str(init_json(root, model)["storage_dir"]))
    fill(ns, 2)
    (root / "ns" / f"{ns.name}.json").unlink()
    code, found = doctor(root, launch(model, "bfloat16"), storage=str(ns))
    assert code == 2
    fix = found["storage-unknown-identity"]["fix"]
    assert fix.endswith(f"or purge it: `cachemgr --root {root} purge --namespace {ns.name} --yes`")
