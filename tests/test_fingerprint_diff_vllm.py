"""`fingerprint diff` for vLLM: records of vLLM launches (`fingerprint --json -- vllm serve …`)
and vLLM namespaces of the root are read as vLLM's records, by their `engine` key through
the engine registry; they used to be read as SGLang's and refused (or compared wrongly)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.nsfixtures import cli
from tests.test_identity import make_model
from tests.vllm_launch import launch, vinit_json


def _record(root: Path, command: list[str], path: Path) -> Path:
    out = cli("--root", str(root), "fingerprint", "--json", "--", *command)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["engine"] == "vllm"
    path.write_text(out.stdout)
    return path


def test_diff_of_two_vllm_launches(tmp_path: Path) -> None:
    model, root = make_model(tmp_path / "model"), tmp_path / "root"
    a = _record(root, launch(model), tmp_path / "a.json")
    b = _record(root, launch(model, "--kv-cache-dtype", "fp8"), tmp_path / "b.json")
    out = cli("fingerprint", "diff", str(a), str(b))
    assert out.returncode == 1, out.stderr
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("kv_cache_dtype")]
    assert line.endswith("→ fp8"), out.stdout
    same = cli("fingerprint", "diff", str(a), str(a))
    assert (same.returncode, same.stdout.strip()) == (0, "same identity"), same.stderr


def test_diff_of_vllm_namespaces_by_id_and_against_a_launch(tmp_path: Path) -> None:
    model, root = make_model(tmp_path / "model"), tmp_path / "root"
    a = vinit_json(root, launch(model), "--instance", "a")["ns_id"]
    b = vinit_json(root, launch(model, "--kv-cache-dtype", "fp8"), "--instance", "b")["ns_id"]
    out = cli("--root", str(root), "fingerprint", "diff", a, b)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert any(ln.startswith("kv_cache_dtype") for ln in out.stdout.splitlines()), out.stdout
    launched = _record(root, launch(model), tmp_path / "a.json")
    same = cli("--root", str(root), "fingerprint", "diff", a, str(launched))
    assert (same.returncode, same.stdout.strip()) == (0, "same identity"), same.stderr


def test_diff_of_a_vllm_and_an_sglang_record_names_the_engine(tmp_path: Path) -> None:
    model, root = make_model(tmp_path / "model"), tmp_path / "root"
    v = _record(root, launch(model), tmp_path / "v.json")
    s = tmp_path / "s.json"
    out = cli("--root", str(root), "fingerprint", "--json", "--model-path", str(model))
    s.write_text(out.stdout)
    diff = cli("fingerprint", "diff", str(s), str(v))
    assert diff.returncode == 1, diff.stderr
    assert "engine: sglang → vllm" in diff.stdout.splitlines(), diff.stdout
