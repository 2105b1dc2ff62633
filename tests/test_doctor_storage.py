"""doctor compares the launch's identity with what the storage dir the server would use holds."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
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


def pasted(fix: str) -> list[str]:
    """The commands a fix gives (each in backticks), in order."""
    return re.findall(r"`([^`]+)`", fix)


def run_pasted(line: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`line` as a user pastes it into a shell whose environment has `env`, cachemgr on the
    PATH (this venv's)."""
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    return subprocess.run(
        ["bash", "-c", line],
        capture_output=True,
        text=True,
        env={**os.environ, **env, "PATH": path},
        timeout=120,
    )


# What a plain dir holds beside SGLang's pages: a temp SGLang is writing, and other programs'
# files, one a LoRA adapter whose name starts with hex digits ("ada…") as a page's key does
NOT_PAGES = sorted([f".{'a' * 32}.tmp", "notes.bin", "adapter_model.bin", "data_0.bin"])


def plain_dir(d: Path, pages: int) -> None:
    """An SGLang dir cachemgr never managed: pages, and NOT_PAGES."""
    d.mkdir()
    for i in range(pages):
        (d / page_name(i)).write_bytes(b"k" * 10)
    for name in NOT_PAGES:
        (d / name).write_bytes(b"not a page")


def test_a_plain_sglang_dirs_fixes_work_as_pasted(root: Path, model: Path, tmp_path: Path) -> None:
    """A plain dir with pages and no manifest: its fix, pasted as it is, either moves the pages
    into the launch's namespace (who knows they are its) or deletes them, and exec's line
    carries no storage dir of its own. Before, the fix said init "adopts" the dir (it made an
    empty namespace and left the pages where they were) and the exec line was refused."""
    plain = tmp_path / "hicache"
    plain_dir(plain, 3)
    cmd = launch(model, "bfloat16")
    code, found = doctor(root, cmd, storage=str(plain))
    assert code == 2
    finding = found["storage-unknown-identity"]
    assert finding["message"].startswith(f"storage dir {plain} has 3 pages and no manifest")
    assert "unknown identity" in finding["message"]
    exec_line, delete, init, move = pasted(finding["fix"])
    # The shell still sets the variable: exec would refuse it, so the line unsets it first;
    # set by the command too, it is taken out of the command as well.
    assert exec_line == f"env -u {STORAGE_ENV} cachemgr --root {root} exec -- {shlex.join(cmd)}"
    both = ["env", f"{STORAGE_ENV}={plain}", *cmd]
    (both_line,) = [
        c
        for c in pasted(doctor(root, both, str(plain))[1]["storage-unknown-identity"]["fix"])
        if " exec " in c
    ]
    assert both_line == exec_line
    as_set = {STORAGE_ENV: str(plain)}
    for line in (init, move):
        done = run_pasted(line, as_set)
        assert done.returncode == 0, (line, done.stderr)
    (ns,) = [d for d in (root / "ns").iterdir() if d.is_dir()]
    assert sorted(p.name for p in ns.iterdir()) == [page_name(i) for i in range(3)]
    assert sorted(p.name for p in plain.iterdir()) == NOT_PAGES
    code, found = doctor(root, cmd)
    assert "storage-unknown-identity" not in found and code == 0, found
    # The other way (an identity with no namespace yet): deleted, only SGLang's pages.
    other, fp8 = tmp_path / "other", launch(model, "fp8_e4m3")
    plain_dir(other, 2)
    delete = pasted(doctor(root, fp8, storage=str(other))[1]["storage-unknown-identity"]["fix"])[1]
    assert run_pasted(delete, {}).returncode == 0
    assert sorted(p.name for p in other.iterdir()) == NOT_PAGES
    # Empty, it holds nothing to be served: only the unmanaged-dir warning stays.
    assert doctor(root, fp8, storage=str(other))[1].keys() == {"unmanaged-dir"}


def test_a_namespace_dir_without_manifest_gets_it_back_when_its_id_is_the_launchs(
    root: Path, model: Path
) -> None:
    """The id of a namespace dir says whose pages it holds: init for that identity writes the
    lost manifest back and keeps them; the fix says so, and the purge, as they run."""
    ns = Path(str(init_json(root, model)["storage_dir"]))
    fill(ns, 2)
    (root / "ns" / f"{ns.name}.json").unlink()
    code, found = doctor(root, launch(model, "bfloat16"), storage=str(ns))
    assert code == 2
    init, purge = pasted(found["storage-unknown-identity"]["fix"])
    assert purge == f"cachemgr --root {root} purge --namespace {ns.name} --yes"
    assert run_pasted(init, {STORAGE_ENV: str(ns)}).returncode == 0
    assert (root / "ns" / f"{ns.name}.json").is_file() and len(list(ns.iterdir())) == 2
    assert "storage-unknown-identity" not in doctor(root, launch(model, "bfloat16"))[1]


def test_another_namespace_dir_without_manifest_is_only_purged(root: Path, model: Path) -> None:
    """A namespace dir of another id with no manifest: no init adopts it (init for this launch
    rebinds its instance, and purges the namespace it had when the identity changed: the fix
    that said so purged a namespace it never named). Its purge, pasted, takes it alone."""
    bound = Path(str(init_json(root, model)["storage_dir"]))
    fill(bound, 2)
    stray = root / "ns" / ("b" * 16)
    stray.mkdir()
    fill(stray, 3)
    code, found = doctor(root, launch(model, "fp8_e4m3"), storage=str(stray))
    assert code == 2
    fix = found["storage-unknown-identity"]["fix"]
    assert " init " not in fix
    purge, exec_line = pasted(fix)
    assert purge == f"cachemgr --root {root} purge --namespace {stray.name} --yes"
    assert exec_line.startswith(f"env -u {STORAGE_ENV} cachemgr --root {root} exec -- ")
    assert run_pasted(purge, {STORAGE_ENV: str(stray)}).returncode == 0
    assert not stray.exists() and len(list(bound.iterdir())) == 2
