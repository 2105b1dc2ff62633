"""`cachemgr fingerprint` and `cachemgr fingerprint diff` through the real entry point."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from cachemgr.cli.main import main
from cachemgr.layout import NS_ID_RE

HOUR_AGO = time.time() - 3600


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "Qwen-tiny"
    path.mkdir()
    for i in range(2):
        tensor = np.full((16, 16), i, np.float32)
        save_file({f"w{i}": tensor}, str(path / f"model-{i + 1:05d}-of-00002.safetensors"))
    (path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    for entry in path.iterdir():
        os.utime(entry, (HOUR_AGO, HOUR_AGO))
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run `cachemgr argv…` in-process through main(), as the console script does."""
    code = 0
    try:
        main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_default_output_is_ns_id_and_digest(
    capsys: pytest.CaptureFixture[str], root: Path, model: Path
) -> None:
    root.mkdir(exist_ok=True)  # on a root that exists (fingerprint creates none)
    code, out, _ = run(capsys, "--root", str(root), "fingerprint", "--model-path", str(model))
    assert code == 0
    lines = dict(line.split() for line in out.splitlines())
    assert NS_ID_RE.fullmatch(lines["ns_id"]) and lines["digest"].startswith(lines["ns_id"])
    assert not (root / ".cachemgr").exists()  # fingerprint reads; it makes no state DB
    # `init` keeps its hashes in the digest cache (the state DB under the root); a
    # fingerprint after it reads them from a copy and comes to the same identity.
    assert run(capsys, "--root", str(root), "init", "--model-path", str(model))[0] == 0
    with sqlite3.connect(root / ".cachemgr" / "state.db") as db:
        rows = db.execute("SELECT count(*) FROM digest_cache WHERE algo = 'xxh3-128'").fetchone()
    assert rows[0] == 3
    code, again, _ = run(capsys, "--root", str(root), "fingerprint", "--model-path", str(model))
    assert (code, again) == (0, out)


def test_launch_command_after_dashes_and_options_win(
    capsys: pytest.CaptureFixture[str], root: Path, model: Path
) -> None:
    base = ["--root", str(root), "fingerprint", "--json"]
    launch = ["--", "sglang", "serve", "--model-path", str(model), "--kv-cache-dtype", "bf16"]
    code, out, _ = run(capsys, *base, *launch, "--page-size", "64")
    assert code == 0
    rec = json.loads(out)
    assert (rec["kv_cache_dtype"], rec["page_size"]) == ("bfloat16", 64)
    code, out, _ = run(capsys, *base, "--kv-cache-dtype", "fp8_e4m3", *launch)
    assert json.loads(out)["kv_cache_dtype"] == "fp8_e4m3"


def test_explain_lists_every_component(
    capsys: pytest.CaptureFixture[str], root: Path, model: Path
) -> None:
    code, out, _ = run(
        capsys,
        "--root",
        str(root),
        "fingerprint",
        "--explain",
        "--sglang-version",
        "0.5.23",
        "--",
        "sglang",
        "serve",
        "--model-path",
        str(model),
        "--page-size",
        "64",
    )
    assert code == 0
    for needle in (
        "kv_cache_dtype ",
        "page_size ",
        "hicache_mem_layout ",
        "topology.tp_size ",
        "mamba_ssm_dtype ",
        "sglang_version ",
        "0.5.23 (option)",
        "salt ",
        "model_override_args ",
        "load_format ",
        "page_major_kv_layout ",
        "page_size (from) ",
        "weights  full (xxh3-128), 3 files",
        "model-00002-of-00002.safetensors",
        "config.json",
    ):
        assert needle in out, needle


def test_fast_mode_is_marked_and_differs(
    capsys: pytest.CaptureFixture[str], root: Path, model: Path
) -> None:
    args = ["--root", str(root), "fingerprint", "--json", "--model-path", str(model)]
    full = json.loads(run(capsys, *args)[1])
    fast = json.loads(run(capsys, *args, "--fast")[1])
    assert fast["weights"]["mode"] == "fast" and full["weights"]["mode"] == "full"
    assert fast["digest"] != full["digest"]


def test_diff_of_records_and_manifests(
    capsys: pytest.CaptureFixture[str], root: Path, model: Path, tmp_path: Path
) -> None:
    args = ["--root", str(root), "fingerprint", "--json", "--model-path", str(model)]
    a = tmp_path / "a.json"
    a.write_text(run(capsys, *args)[1])
    b_record = json.loads(run(capsys, *args, "--kv-cache-dtype", "fp8_e4m3", "--tp-size", "2")[1])
    manifest = tmp_path / f"{b_record['ns_id']}.json"  # as <root>/ns/<id>.json will hold it
    manifest.write_text(json.dumps({"identity": b_record, "created_at": 0}))
    code, out, _ = run(capsys, "fingerprint", "diff", str(a), str(manifest))
    assert code == 1
    assert out.splitlines() == ["kv_cache_dtype: bfloat16 → fp8_e4m3", "topology.tp_size: 1 → 2"]
    code, out, _ = run(capsys, "fingerprint", "diff", str(a), str(a))
    assert (code, out.strip()) == (0, "same identity")


def one_line_error(code: int, err: str, needle: str, exit_code: int = 2) -> None:
    assert code == exit_code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cachemgr: error: "), err
    assert needle in lines[0]


def test_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], root: Path, tmp_path: Path
) -> None:
    code, _, err = run(capsys, "--root", str(root), "fingerprint", "--", "sglang", "serve")
    one_line_error(code, err, "no model path")
    missing = tmp_path / "no-such-model"
    code, _, err = run(capsys, "--root", str(root), "fingerprint", "--model-path", str(missing))
    one_line_error(code, err, f"model directory {missing} does not exist", exit_code=1)
    (tmp_path / "junk.json").write_text("[1, 2]")
    code, _, err = run(capsys, "fingerprint", "diff", str(tmp_path / "junk.json"), "/nonexistent")
    one_line_error(code, err, "is not an identity record")


@pytest.mark.timeout(30)
def test_diff_refuses_poisoned_record_files(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A FIFO is refused, not waited on; a huge file is not read; deep nesting is one line."""
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "deep.json").write_text("[" * 200_000)
    with open(tmp_path / "huge.json", "wb") as f:
        f.truncate(2 << 20)
    for name, why in (
        ("fifo", "not a regular file"),
        ("deep", "nested too deeply"),
        ("huge", "larger than"),
    ):
        path = str(tmp_path / f"{name}.json")
        code, _, err = run(capsys, "fingerprint", "diff", path, path)
        one_line_error(code, err, why)


def test_console_script_end_to_end(root: Path, model: Path) -> None:
    """The installed entry point, in a subprocess: same digest as in-process, exit 0."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cachemgr",
            "--root",
            str(root),
            "fingerprint",
            "--json",
            "--",
            "python",
            "-m",
            "sglang.launch_server",
            f"--model-path={model}",
            "--page-size=64",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    rec = json.loads(out.stdout)
    assert rec["page_size"] == 64 and NS_ID_RE.fullmatch(rec["ns_id"])
    assert "Traceback" not in out.stderr


def test_diff_takes_namespace_ids(
    capsys: pytest.CaptureFixture[str], root: Path, model: Path, tmp_path: Path
) -> None:
    launch = ["sglang", "serve", "--model-path", str(model), "--page-size", "64"]
    base = ["--root", str(root)]
    env = os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    try:
        ids = []
        for kv in ("bfloat16", "fp8_e4m3"):
            init = [*base, "init", "--instance", kv, "--json", "--", *launch]
            code, out, err = run(capsys, *init, "--kv-cache-dtype", kv)
            assert code == 0, err
            ids.append(json.loads(out)["ns_id"])
    finally:
        if env is not None:
            os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = env
    code, out, _ = run(capsys, *base, "fingerprint", "diff", *ids)
    assert (code, out.splitlines()) == (1, ["kv_cache_dtype: bfloat16 → fp8_e4m3"])
    record = tmp_path / "b.json"  # an id and a record file mix
    fp8 = [*launch, "--kv-cache-dtype", "fp8_e4m3"]
    record.write_text(run(capsys, *base, "fingerprint", "--json", "--", *fp8)[1])
    code, out, _ = run(capsys, *base, "fingerprint", "diff", ids[1], str(record))
    assert (code, out.strip()) == (0, "same identity")
    code, _, err = run(capsys, *base, "fingerprint", "diff", ids[0], "0123456789abcdef")
    one_line_error(code, err, f"0123456789abcdef is neither a file nor a namespace of {root}", 1)
