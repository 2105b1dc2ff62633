"""`cachemgr doctor`: each HiCache pitfall found with its numbers and fix, and its exit code."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from cachemgr.doctor.finding import command_line, exit_code
from cachemgr.launchenv import server_environ
from cachemgr.layout import Layout
from cachemgr.sglang.args import resolve_launch_args
from cachemgr.sglang.lint import is_hybrid, lint, parse_size
from cachemgr.state.store import Store
from tests.nsfixtures import cli, make_ns
from tests.test_identity import make_model

FILE = "sglang serve --enable-hierarchical-cache --hicache-storage-backend file"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    return path


def doctor(root: Path, command: str, env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """(exit code, codes of the findings) of `cachemgr doctor --json -- command`."""
    out = cli(
        "--root",
        str(root),
        "doctor",
        "--json",
        "--",
        *command.split(),
        env={
            "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": "",
            "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE": "",
            **(env or {}),
        },
    )
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, [f["code"] for f in json.loads(out.stdout)]


def managed_env(root: Path) -> dict[str, str]:
    return {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(root / "ns" / "0123456789abcdef")}


def test_page_size_1_is_an_error_with_the_numbers(root: Path, model: Path) -> None:
    out = cli(
        "--root",
        str(root),
        "doctor",
        "--",
        *FILE.split(),
        "--page-size",
        "1",
        "--model-path",
        str(model),
        env=managed_env(root),
    )
    assert out.returncode == 2
    (line,) = out.stdout.splitlines()
    assert line.startswith("error   page-size-1: ")
    assert "15.4 GB in 400,000 files and 0 hits" in line and "fix: --page-size 64" in line


def test_page_size_left_to_sglang_is_a_warning_not_an_error(root: Path, model: Path) -> None:
    out = cli(
        "--root",
        str(root),
        "doctor",
        "--",
        *FILE.split(),
        "--model-path",
        str(model),
        env=managed_env(root),
    )
    assert out.returncode == 1
    (line,) = out.stdout.splitlines()
    assert line.startswith("warning page-size-unpinned: ")
    assert "SGLang decides it on the GPU" in line and "fix: pin it: --page-size 64" in line
    # A backend that forces the page size settles it without the flag.
    forced = f"{FILE} --model-path {model} --attention-backend flashmla"
    assert doctor(root, forced, managed_env(root)) == (0, [])


def test_a_good_launch_is_clean(root: Path, model: Path) -> None:
    code, found = doctor(root, f"{FILE} --page-size 64 --model-path {model}", managed_env(root))
    assert (code, found) == (0, [])


def test_unmanaged_storage_dir_warns(root: Path, model: Path) -> None:
    cmd = f"{FILE} --page-size 64 --model-path {model}"
    assert doctor(root, cmd) == (1, ["unmanaged-dir"])  # SGLang's default /tmp/hicache
    extra = '--hicache-storage-backend-extra-config {"file_storage_path":"/srv/kv"}'
    assert doctor(root, f"{cmd} {extra}") == (1, ["unmanaged-dir"])


@pytest.mark.parametrize(
    ("config", "interval", "expected"),
    [
        ({"layer_types": ["linear_attention", "full_attention"]}, 100, ["mamba-track-interval"]),
        ({"architectures": ["NemotronHForCausalLM"]}, 100, ["mamba-track-interval"]),
        ({"text_config": {"mamba_d_state": 128}}, 96, ["mamba-track-interval"]),
        ({"layer_types": ["linear_attention"]}, 256, []),
        ({"architectures": ["Qwen3ForCausalLM"]}, 100, []),  # not hybrid: the interval is unused
    ],
)
def test_mamba_track_interval_on_hybrid_models(
    root: Path, model: Path, config: dict[str, object], interval: int, expected: list[str]
) -> None:
    (model / "config.json").write_text(json.dumps(config))
    cmd = f"{FILE} --page-size 64 --model-path {model} --mamba-track-interval {interval}"
    code, found = doctor(root, cmd, managed_env(root))
    assert found == expected and code == (2 if expected else 0)


def test_mamba_check_uses_the_resolved_page_size(root: Path, model: Path) -> None:
    (model / "config.json").write_text(json.dumps({"layer_types": ["linear_attention"]}))
    unpinned = f"{FILE} --model-path {model} --mamba-track-interval 100"
    assert doctor(root, unpinned, managed_env(root)) == (1, ["page-size-unpinned"])
    forced = f"{unpinned} --attention-backend flashmla"  # forces 64: 100 % 64 != 0
    assert doctor(root, forced, managed_env(root)) == (2, ["mamba-track-interval"])


def test_sglang_evictor_conflicts_with_cachemgr(root: Path, model: Path) -> None:
    cmd = f"{FILE} --page-size 64 --model-path {model}"
    env = {**managed_env(root), "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE": "2G"}
    assert doctor(root, cmd, env) == (1, ["sglang-evictor"])
    in_launch = f"env SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE=1Gi {cmd}"
    assert doctor(root, in_launch, managed_env(root)) == (1, ["sglang-evictor"])
    extra = '--hicache-storage-backend-extra-config {"max_size":"1G"}'
    assert doctor(root, f"{cmd} {extra}", managed_env(root)) == (1, ["sglang-evictor"])


def test_two_cache_owners_are_named(root: Path, model: Path) -> None:
    """SGLang's evictor and cachemgr's gc_max_bytes together: one warning naming both caps."""
    cmd = f"{FILE} --page-size 64 --model-path {model}"
    env = {**managed_env(root), "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE": "2G"}
    out = cli(
        "--root",
        str(root),
        "doctor",
        "--json",
        "--",
        *cmd.split(),
        env={**env, "CACHEMGR_GC_MAX_BYTES": "3GB"},
    )
    (warning,) = [f for f in json.loads(out.stdout) if f["code"] == "sglang-evictor"]
    assert "gc_max_bytes 3.0 GB" in warning["message"] and "two owners" in warning["message"]
    out = cli("--root", str(root), "doctor", "--json", "--", *cmd.split(), env=env)
    (alone,) = [f for f in json.loads(out.stdout) if f["code"] == "sglang-evictor"]
    assert "two owners" not in alone["message"]


def test_cap_larger_than_free_space(root: Path, model: Path) -> None:
    args = resolve_launch_args(f"{FILE} --page-size 64 --tp-size 8 --model-path {model}")
    layout = Layout.at(root)
    env = {**managed_env(root), "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE": "100G"}
    seen: list[Path] = []

    def free(path: Path) -> int:
        seen.append(path)
        return 500 * 10**9

    found = lint(args, layout=layout, env=env, model_config={}, disk_free=free)
    disk = [f for f in found if f.code == "disk-smaller-than-cap"]
    assert len(disk) == 1 and "500.0 GB free, less than the cap of 800.0 GB" in disk[0].message
    assert seen == [root / "ns" / "0123456789abcdef"]
    found = lint(args, layout=layout, env=env, model_config={}, disk_free=lambda _: 10**13)
    assert "disk-smaller-than-cap" not in [f.code for f in found]
    own = lint(
        args,
        layout=layout,
        env=managed_env(root),
        model_config={},
        cap_bytes=10**12,
        disk_free=free,
    )
    assert [f.code for f in own] == ["disk-smaller-than-cap"]


def test_no_hicache_or_another_backend_warns(root: Path, model: Path) -> None:
    plain = f"sglang serve --model-path {model} --page-size 64"
    assert doctor(root, plain) == (1, ["no-hicache"])
    mooncake = f"{plain} --enable-hierarchical-cache --hicache-storage-backend mooncake"
    assert doctor(root, mooncake) == (1, ["not-file-backend"])


def test_root_damage_is_reported(layout: Layout, tmp_path: Path) -> None:
    (layout.ns_root / ("c" * 16)).mkdir()
    (layout.trash / f"{'d' * 16}.x1").mkdir()
    (layout.trash / f"{'e' * 16}.x2").symlink_to(tmp_path)
    aside = layout.state_dir / "state.db.corrupt-1764400000"  # left by a DB recovery
    for suffix in ("", "-wal"):
        Path(f"{aside}{suffix}").write_bytes(b"junk")
    out = cli("--root", str(layout.root), "doctor", "--json")
    findings = json.loads(out.stdout)
    codes = sorted(f["code"] for f in findings)
    assert codes == ["ns-no-manifest", "state-db-corrupt", "trash-left", "trash-unsafe"]
    (db,) = [f for f in findings if f["code"] == "state-db-corrupt"]
    assert str(aside) in db["message"] and str(aside) in db["fix"]
    assert out.returncode == 2
    # Each command a fix gives names this root: pasted in another shell, one without --root
    # acted on the default root, or found none.
    commands = [c for f in findings for c in re.findall(r"`(cachemgr [^`]*)`", f["fix"])]
    assert len(commands) == 2  # the namespace's purge; the trash's drain, by GC
    assert all(c.startswith(f"cachemgr --root {layout.root} ") for c in commands), commands
    assert "--unbound" not in str(commands)  # (that purges every unbound namespace)
    # A state dir of its own is named too: from another shell the fix would use another DB.
    aside = Layout.at(layout.root, tmp_path / "state")
    assert command_line(aside, "gc", "--yes") == (
        f"cachemgr --root {layout.root} --state-dir {tmp_path / 'state'} gc --yes"
    )


def test_helpers() -> None:
    assert parse_size("200G") == 200 * 10**9 and parse_size("1Gi") == 2**30
    assert parse_size("25.6k") == 25600 and parse_size("0") is None
    assert parse_size("") is None and parse_size("lots") is None
    command = ["env", "A=1", "B=x=y", "sglang", "C=2"]
    assert server_environ(command, {"A": "0", "D": "d"}) == {"A": "1", "B": "x=y", "D": "d"}
    assert is_hybrid({"model_type": "qwen3_next"}) and not is_hybrid({"model_type": "llama"})
    assert exit_code([]) == 0


def test_the_launch_given_to_exec_is_not_unmanaged(root: Path, tmp_path: Path) -> None:
    # exec and init set the storage dir to the launch's namespace: doctor on the same launch
    # (its own env says nothing of it) lints that namespace, not SGLang's default dir.
    model = make_model(tmp_path / "weights")
    launch = f"{FILE} --page-size 64 --model-path {model}"
    assert doctor(root, launch) == (1, ["unmanaged-dir"])  # never run under exec here
    no_env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": ""}
    made = cli("--root", str(root), "init", "--", *launch.split(), env=no_env)
    assert made.returncode == 0, made.stderr
    assert doctor(root, launch) == (0, ["exec-namespace"])
    # Another KV dtype is another identity, with no namespace yet.
    assert doctor(root, f"{launch} --kv-cache-dtype fp8_e4m3") == (1, ["unmanaged-dir"])


def test_a_bound_namespace_without_its_dir_is_an_error(layout: Layout) -> None:
    store = Store.open(layout.db_path)
    try:
        ns = make_ns(layout, store, "a", pages=2, instance="srv")
    finally:
        store.close()
    shutil.rmtree(layout.ns_dir(ns))  # by hand, or a purge killed between two renames
    out = cli("--root", str(layout.root), "doctor", "--json")
    (finding,) = json.loads(out.stdout)
    assert finding["code"] == "ns-missing-dir" and "bound to srv" in finding["message"]
    assert out.returncode == 2


def test_the_hybrid_check_reads_the_config_beside_a_gguf_file(root: Path, tmp_path: Path) -> None:
    """SGLang serves a GGUF file with the config.json beside it: doctor read the model path as
    a model dir only, called a local GGUF file not local, and skipped the hybrid-model check."""
    files = tmp_path / "gguf"
    files.mkdir()
    (files / "m-Q4_K_M.gguf").write_bytes(b"GGUF" + b"q" * 64)
    cmd = f"{FILE} --page-size 64 --model-path {files / 'm-Q4_K_M.gguf'} --mamba-track-interval 100"
    assert doctor(root, cmd, managed_env(root)) == (0, ["model-not-local"])  # config in the file
    (files / "config.json").write_text(json.dumps({"layer_types": ["linear_attention"]}))
    assert doctor(root, cmd, managed_env(root)) == (2, ["mamba-track-interval"])


def test_hard_linked_pages_are_reported_with_an_example_and_the_fix(
    layout: Layout, tmp_path: Path
) -> None:
    """A GC run says a limit is not held because the pages it deleted were hard links another
    name keeps, and sends people to doctor: doctor names the namespace, how many of the pages
    it sampled are linked, one of them, and how to find and remove the other links."""
    store = Store.open(layout.db_path)
    try:
        ns = make_ns(layout, store, "a", pages=6, instance="srv")
        clean = make_ns(layout, store, "b", pages=3, instance="srv2")
    finally:
        store.close()
    backup = tmp_path / "backup"  # an operator's `cp -al` of part of the cache
    backup.mkdir()
    linked = sorted(layout.ns_dir(ns).glob("*.bin"))[:4]
    for page in linked:
        os.link(page, backup / page.name)
    out = cli("--root", str(layout.root), "doctor", "--json")
    (finding,) = json.loads(out.stdout)
    assert finding["code"] == "hard-linked-pages", finding
    assert finding["message"].startswith(f"ns {ns}: 4 of the 6 page files doctor sampled ")
    (example,) = [p for p in linked if str(p) in finding["message"]]
    assert f"-samefile {example}" in finding["fix"]
    assert clean not in finding["message"]
    assert out.returncode == 1
