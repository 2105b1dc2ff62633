"""`cachemgr init` / `exec` / `fingerprint` on vLLM launches: the argv pre-pass, the identity,
the fs tier's root_dir rewrite, refusals before anything is made (real CLI, real model dirs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cachemgr.vllm.flags import CHOICES
from tests.conftest import ScriptRunner
from tests.nsfixtures import cli, cli_process, one_line_error
from tests.test_identity import make_model
from tests.vllm_launch import (
    launch,
    multi_config,
    root_dir_of,
    tier_config,
    vinit,
    vinit_json,
)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return make_model(tmp_path / "model")


def exec_fake(
    root: Path, command: list[str], fake_vllm: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """`cachemgr exec -- COMMAND` with the `vllm` that prints its argv; it succeeded."""
    proc = subprocess.run(
        [sys.executable, "-m", "cachemgr", "--root", str(root), "exec", "--", *command],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **fake_vllm},
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def fingerprint(command: list[str], tmp_path: Path) -> dict[str, object]:
    out = cli("--root", str(tmp_path / "fp-root"), "fingerprint", "--json", "--", *command)
    assert out.returncode == 0, out.stderr
    data: dict[str, object] = json.loads(out.stdout)
    return data


def test_hf_config_path_is_the_config_vllm_reads(model: Path, tmp_path: Path) -> None:
    """vLLM builds the model from --hf-config-path's config.json instead of the model dir's
    (ModelConfig: get_config(hf_config_path or model)), and its folder digest does not name
    it: a RoPE change there shared the namespace (and vLLM's folder) with the model's own."""
    base = fingerprint(launch(model), tmp_path)
    config = json.loads((model / "config.json").read_text())
    same, scaled = tmp_path / "same", tmp_path / "scaled"
    for d, extra in ((same, {}), (scaled, {"rope_scaling": {"rope_type": "linear", "factor": 4}})):
        d.mkdir()
        # (another key order and spacing: the content is what counts)
        (d / "config.json").write_text(json.dumps(dict(reversed(config.items())) | extra, indent=1))
    assert fingerprint(launch(model, "--hf-config-path", str(same)), tmp_path) == base
    other = fingerprint(launch(model, "--hf-config-path", str(scaled)), tmp_path)
    assert other["ns_id"] != base["ns_id"]


def test_an_attention_backend_given_is_in_the_identity(model: Path, tmp_path: Path) -> None:
    """The backend decides the KV layout with the offloading connector (FlexAttention takes
    only LBNHC where the connector asks LBHNC; hisparse asks BLHNC), and vLLM's folder name
    does not say it: switching backends wrote blocks of another layout into the same folder."""

    def ns(*flags: str) -> object:
        return fingerprint(launch(model, *flags), tmp_path)["ns_id"]

    plain = ns()
    assert ns("--attention-backend", "auto") == plain
    assert ns("--attention-backend", "") == plain  # ("$ATTN" empty: vLLM reads it as unset)
    flex = ns("--attention-backend", "FLEX_ATTENTION")
    assert flex != plain
    assert ns("--attention-backend", "flex_attention") == flex
    assert ns("-ac", '{"backend": "FLEX_ATTENTION"}') == flex
    assert ns("--attention-config.backend", "FLEX_ATTENTION") == flex
    assert ns("-ac", '{"hisparse_config": {}}') not in (plain, flex)
    both = ["--attention-backend", "FLASH_ATTN", "-ac", '{"backend": "FLEX_ATTENTION"}']
    out = cli("--root", str(tmp_path / "r"), "fingerprint", "--", *launch(model, *both))
    assert out.returncode == 2 and "vLLM takes one" in one_line_error(out)
    # names vLLM's start refuses (AttentionBackendEnum, KVCacheSpecKind): refused first
    for bad, says in (
        (["--attention-backend", "BOGUS"], "invalid attention backend 'BOGUS'"),
        (["--attention-backend", "flash-attn"], "invalid attention backend"),
        (["-ac", '{"backend_per_kind": {"full_attention": "BOGUS"}}'], "invalid attention"),
        (["-ac", '{"backend_per_kind": {"bogus": "FLASH_ATTN"}}'], "backend_per_kind key"),
    ):
        out = cli("--root", str(tmp_path / "r"), "fingerprint", "--", *launch(model, *bad))
        assert out.returncode == 2 and says in one_line_error(out), bad


def test_init_makes_a_vllm_namespace_and_rewrites_the_tier(root: Path, model: Path) -> None:
    result = vinit_json(root, launch(model, "--kv-cache-dtype", "fp8"), "--vllm-version", "0.33.0")
    ns_dir = root / "ns" / result["ns_id"]
    assert result["outcome"] == "created" and ns_dir.is_dir()
    assert root_dir_of(result["command"]) == str(ns_dir)
    env = result["env"]
    assert env["CACHEMGR_VLLM_ROOT_DIR"] == str(ns_dir)
    pointed = tier_config(str(ns_dir))  # the launch's whole config, its tier pointed there
    assert json.loads(env["CACHEMGR_VLLM_KV_TRANSFER_CONFIG"]) == pointed
    manifest = json.loads((root / "ns" / f"{result['ns_id']}.json").read_text())
    identity = manifest["identity"]
    assert identity["engine"] == "vllm"  # the contract with the file-format side
    assert (identity["kv_cache_dtype"], identity["vllm_version"]) == ("fp8", "0.33")
    assert identity["source"]["root_dir_arg"] == "/srv/kv"


def _forms(model: Path, tmp_path: Path) -> dict[str, list[str]]:
    cfg = tier_config()
    tiers = json.dumps(cfg["kv_connector_extra_config"]["secondary_tiers"])
    yaml_file = tmp_path / "serve.yaml"
    yaml_file.write_text(
        "kv_cache_dtype: fp8\nmax-model-len: 32k\n"
        "hf_overrides:\n  rope_scaling:\n    factor: 4\n"
        f"kv-transfer-config: {json.dumps(cfg)}\n"
    )
    plain = launch(
        model,
        "--kv-cache-dtype",
        "fp8",
        "--max-model-len",
        "32000",
        "--hf-overrides",
        '{"rope_scaling": {"factor": 4}}',
        "-tp",
        "2",
    )
    forms = {
        "plain": plain,
        "underscores": launch(
            model,
            "--kv_cache_dtype=fp8",
            "--max_model_len",
            "32k",
            "--hf_overrides",
            '{"rope_scaling":{"factor":4}}',
            "--tensor_parallel_size",
            "2",
        ),
        "dotted": [
            "vllm",
            "serve",
            str(model),
            "--kv-cache-dtype",
            "fp8",
            "-tp",
            "2",
            "--max-model-len=32k",
            "--hf-overrides.rope_scaling.factor",
            "4",
            "--kv-transfer-config.kv_connector",
            "OffloadingConnector",
            "--kv-transfer-config.kv_role=kv_both",
            "--kv-transfer-config.kv_connector_extra_config.spec_name=TieringOffloadingSpec",
            "--kv-transfer-config.kv_connector_extra_config.secondary_tiers",
            tiers,
        ],
        "config": ["vllm", "serve", str(model), "--config", str(yaml_file), "-tp", "2"],
        # vLLM's argparse takes a unique prefix of the flag in a dotted key too
        "abbreviated": [
            "vllm",
            "serve",
            str(model),
            "--kv-cache-dtype=fp8",
            "-tp",
            "2",
            "--max-model-le=32k",
            "--hf-overrid.rope_scaling.factor",
            "4",
            "--kv-transfer-conf.kv_connector",
            "OffloadingConnector",
            "--kv-transfer-conf.kv_role=kv_both",
            "--kv-transfer-conf.kv_connector_extra_config.spec_name=TieringOffloadingSpec",
            "--kv-transfer-conf.kv_connector_extra_config.secondary_tiers",
            tiers,
        ],
        "model_flag": ["vllm", "serve", "-tp", "2", "--model", str(model), *plain[3:]],
        "api_server": [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            *plain[3:],
        ],
    }
    return forms


def test_the_prepass_forms_give_the_plain_forms_identity(model: Path, tmp_path: Path) -> None:
    forms = _forms(model, tmp_path)
    digests = {name: fingerprint(cmd, tmp_path)["digest"] for name, cmd in forms.items()}
    assert len(set(digests.values())) == 1, digests
    # …and one setting of it differs from the plain form's, to show the forms are read at all.
    other = fingerprint([*forms["dotted"], "--hf-overrides.rope_scaling.factor", "8"], tmp_path)
    assert other["digest"] != digests["plain"]


@pytest.mark.parametrize("form", ["dotted", "config", "underscores", "abbreviated"])
def test_each_form_gets_its_tier_pointed_at_the_namespace(
    root: Path, model: Path, tmp_path: Path, form: str
) -> None:
    result = vinit_json(root, _forms(model, tmp_path)[form])
    ns_dir = str(root / "ns" / result["ns_id"])
    command = result["command"]
    if form in ("dotted", "abbreviated"):  # rewritten in place, still a dotted key
        key = "--kv-transfer-conf" + ("ig" if form == "dotted" else "")
        at = command.index(f"{key}.kv_connector_extra_config.secondary_tiers")
        assert json.loads(command[at + 1]) == [{"type": "fs", "root_dir": ns_dir}]
    elif form == "config":  # the file is left alone; the command line overrides it
        given = _forms(model, tmp_path)["config"]
        assert command[: len(given)] == given and root_dir_of(command) == ns_dir
    else:
        assert (
            any(
                a.startswith("--kv_transfer_config=") or a == "--kv-transfer-config"
                for a in command
            )
            and root_dir_of(command) == ns_dir
        )


CHANGES = {
    "kv_cache_dtype": (["--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "fp8_e5m2"]),
    "block_size": (["--block-size", "16"], ["--block-size", "32"]),
    "topology.tp_size": (["-tp", "1"], ["-tp", "2"]),
    "quantization": ([], ["-q", "fp8"]),
    "hf_overrides": ([], ["--hf-overrides.rope_scaling.factor", "4"]),
    "max_model_len": (["--max-model-len", "8k"], ["--max-model-len", "16k"]),
    "prefix_caching_hash_algo": ([], ["--prefix-caching-hash-algo", "xxhash"]),
    "dtype": (["--dtype", "bfloat16"], ["--dtype", "float16"]),
    "kv_cache_layout": ([], ["env", "VLLM_KV_CACHE_LAYOUT=HND"]),
    # how an online quantization quantizes the weights the KV is computed with
    "quantization_config": (
        ["--quantization-config", '{"linear": {"weight_bits": 8}}'],
        ["--quantization-config", '{"linear": {"weight_bits": 4}}'],
    ),
    # layers whose KV stays unquantized: vLLM's folder name has only the KV dtype
    "kv_cache_dtype_skip_layers": (
        ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "0"],
        ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "0", "1"],
    ),
    # a hybrid model's offloaded Mamba state: vLLM's folder name has no dtype of it
    "mamba_cache_dtype": ([], ["--mamba-cache-dtype", "float32"]),
    "mamba_ssm_cache_dtype": (
        ["--mamba-ssm-cache-dtype", "bfloat16"],
        ["--mamba-ssm-cache-dtype", "float32"],
    ),
}


def test_skip_layers_are_a_set_of_every_value_given(root: Path, model: Path) -> None:
    """vLLM tests a layer's index (or `sliding_window`) for membership in the list: order and
    repeats do not count, every value does, and without the flag the id is the one before."""
    fp8 = ["--kv-cache-dtype", "fp8"]
    plain = vinit_json(root, launch(model, *fp8))["ns_id"]
    one = vinit_json(root, launch(model, *fp8, "--kv-cache-dtype-skip-layers", "1", "0"))
    assert one["ns_id"] != plain
    assert one["changes"] == ["kv_cache_dtype_skip_layers: none → ['0', '1']"]
    same = ["--kv-cache-dtype-skip-layers", "0", "1", "0", "--port", "8001"]
    assert vinit_json(root, launch(model, *fp8, *same))["ns_id"] == one["ns_id"]
    # the last occurrence wins, as argparse stores a repeated flag
    repeated = ["--kv-cache-dtype-skip-layers", "5", "--kv-cache-dtype-skip-layers", "0", "1"]
    assert vinit_json(root, launch(model, *fp8, *repeated))["ns_id"] == one["ns_id"]


def test_a_quantization_config_is_read_as_vllm_reads_it(root: Path, model: Path) -> None:
    """Key order, spaces, dotted keys and human-readable numbers do not count; an empty one is
    the launch without it; one that is no JSON object is refused before anything is made."""
    plain = vinit_json(root, launch(model))["ns_id"]
    given = vinit_json(root, launch(model, "--quantization-config", '{"a": 1, "b": {"c": 2k}}'))
    assert given["ns_id"] != plain
    same = ["--quantization-config.b.c", "2000", "--quantization-config.a", "1"]
    assert vinit_json(root, launch(model, *same))["ns_id"] == given["ns_id"]
    assert vinit_json(root, launch(model, "--quantization-config", "{}"))["ns_id"] == plain
    out = vinit(root, launch(model, "--quantization-config", "[1]"))
    assert out.returncode == 2 and "--quantization-config is not a JSON object" in one_line_error(
        out
    )


def test_an_auto_mamba_dtype_is_the_launch_without_it(root: Path, model: Path) -> None:
    """`auto` (the model's own dtype, which its hashed config says) keeps the id launches had
    before the Mamba dtypes were recorded; a dtype vLLM does not list is refused first."""
    plain = vinit_json(root, launch(model))["ns_id"]
    auto = ["--mamba-cache-dtype", "auto", "--mamba-ssm-cache-dtype", "auto"]
    assert vinit_json(root, launch(model, *auto))["ns_id"] == plain
    out = vinit(root, launch(model, "--mamba-cache-dtype", "fp8"))
    assert out.returncode == 2 and "invalid --mamba-cache-dtype 'fp8'" in one_line_error(out)


@pytest.mark.parametrize("component", sorted(CHANGES))
def test_a_changed_component_gets_a_new_namespace_and_purges_the_old(
    root: Path, model: Path, component: str
) -> None:
    before, after = CHANGES[component]

    def command(flags: list[str]) -> list[str]:
        env = flags[:2] if flags[:1] == ["env"] else []
        return [*env, *launch(model, *flags[len(env) :])]

    first = vinit_json(root, command(before), "--vllm-version", "0.33.0")
    (root / "ns" / first["ns_id"] / "stale.bin").write_bytes(b"x")
    second = vinit_json(root, command(after), "--vllm-version", "0.33.0")
    assert second["outcome"] == "changed" and second["ns_id"] != first["ns_id"]
    assert any(c.startswith(f"{component}:") for c in second["changes"]), second["changes"]
    assert component in second["message"] and "purged ns" in second["message"]
    assert not (root / "ns" / first["ns_id"]).exists()


def test_a_new_vllm_version_is_a_new_namespace(root: Path, model: Path) -> None:
    first = vinit_json(root, launch(model), "--vllm-version", "0.33.0")
    second = vinit_json(root, launch(model), "--vllm-version", "0.34.1")
    assert second["changes"] == ["vllm_version: 0.33 → 0.34"]
    assert not (root / "ns" / first["ns_id"]).exists()


def test_the_same_launch_twice_keeps_its_namespace(root: Path, model: Path) -> None:
    first = vinit_json(root, launch(model))
    (root / "ns" / first["ns_id"] / "block.bin").write_bytes(b"x")
    again = vinit_json(root, launch(model, "--port", "8001", "--served-model-name", "a", "b"))
    assert (again["outcome"], again["ns_id"]) == ("unchanged", first["ns_id"])
    assert (root / "ns" / first["ns_id"] / "block.bin").exists()


# Dotted keys that make a connector whose tier list vLLM runs.
TIERING = [
    *["--kv-transfer-config.kv_connector", "OffloadingConnector"],
    *["--kv-transfer-config.kv_role", "kv_both"],
    *["--kv-transfer-config.kv_connector_extra_config.spec_name", "TieringOffloadingSpec"],
]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--kv-cache-dtype", "fp9_bogus"], "invalid --kv-cache-dtype 'fp9_bogus': vLLM 0.34.0"),
        (["--block-size", "16.0"], "invalid --block-size '16.0': vLLM 0.34.0 takes an integer"),
        (["--max-model-len", "1.5K"], "invalid --max-model-len '1.5K'"),
        (["--kv-transfer-config", "{not json"], "--kv-transfer-config is not a JSON object"),
        (
            ["--kv-transfer-config.kv_connector_extra_config.secondary_tiers", '{"type": "fs"}'],
            "secondary_tiers is not a list of objects",
        ),
        (["--hf-overrides", "[1]"], "--hf-overrides is not a JSON object"),
        (
            ["--kv-transfer-config", json.dumps({**tier_config(), "kv_role": "kv_nobody"})],
            "kv_role 'kv_nobody' is not one of",
        ),
        (["--kv-cache-dtype"], "--kv-cache-dtype needs a value"),
        (
            [
                *TIERING,
                "--kv-transfer-config.kv_connector_extra_config.secondary_tiers",
                '[{"type": "fs", "root_dir": "/a"}, {"type": "fs", "root_dir": "/b"}]',
            ],
            "has 2 fs tiers: cachemgr manages one per server",
        ),
        (
            [
                *TIERING,
                "--kv-transfer-config.kv_connector_extra_config.secondary_tiers",
                '[{"type": "fs"}]',
            ],
            'the fs tier has no "root_dir" string',
        ),
    ],
)
def test_a_bad_value_is_one_line_exit_2_and_nothing_is_made(
    tmp_path: Path, model: Path, fake_vllm: dict[str, str], flags: list[str], says: str
) -> None:
    root = tmp_path / "root"
    for command in ("init", "exec"):
        out = cli("--root", str(root), command, "--", *launch(model), *flags, env=fake_vllm)
        assert out.returncode == 2 and says in one_line_error(out), out.stderr
        assert not root.exists()
    assert len(CHOICES["kv_cache_dtype"]) == 22


def test_a_bad_value_leaves_an_existing_namespace_alone(root: Path, model: Path) -> None:
    first = vinit_json(root, launch(model))
    (root / "ns" / first["ns_id"] / "block.bin").write_bytes(b"x")
    out = vinit(root, launch(model, "--kv-cache-dtype", "fp9_bogus"))
    assert out.returncode == 2
    assert (root / "ns" / first["ns_id"] / "block.bin").exists()


def test_a_launch_without_an_fs_tier_is_refused(tmp_path: Path, model: Path) -> None:
    root = tmp_path / "root"
    no_fs = tier_config()
    no_fs["kv_connector_extra_config"]["secondary_tiers"] = [{"type": "obj", "bucket": "b"}]
    for command in (["vllm", "serve", str(model)], launch(model, config=no_fs)):
        out = vinit(root, command)
        assert out.returncode == 2 and "has no fs tier" in one_line_error(out)
        assert not root.exists()


def test_sglang_options_with_a_vllm_launch_are_refused(tmp_path: Path, model: Path) -> None:
    out = cli("--root", str(tmp_path / "r"), "init", "--page-size", "64", "--", *launch(model))
    assert out.returncode == 2 and "--page-size is an SGLang option" in one_line_error(out)


def test_exec_runs_vllm_with_the_tier_pointed_at_the_namespace(
    root: Path, model: Path, fake_vllm: dict[str, str]
) -> None:
    tiers = json.dumps(tier_config()["kv_connector_extra_config"]["secondary_tiers"])
    command = [
        "vllm",
        "serve",
        str(model),
        "--kv-transfer-config.kv_connector",
        "OffloadingConnector",
        "--kv-transfer-config.kv_role",
        "kv_both",
        "--kv-transfer-config.kv_connector_extra_config.spec_name",
        "TieringOffloadingSpec",
        "--kv-transfer-config.kv_connector_extra_config.secondary_tiers",
        tiers,
    ]
    proc = exec_fake(root, command, fake_vllm)
    argv = json.loads(proc.stdout)
    (ns,) = [p for p in (root / "ns").iterdir() if p.is_dir()]
    assert argv[:4] == [*command[1:4], "OffloadingConnector"]
    assert json.loads(argv[-1]) == [{"type": "fs", "root_dir": str(ns)}]
    assert f"created ns {ns.name}" in proc.stderr


def test_init_without_vllm_keeps_the_namespace_made_where_it_is_installed(
    root: Path, model: Path, tmp_path: Path
) -> None:
    site = tmp_path / "site" / "vllm-0.33.0.dist-info"  # `vllm` installed: metadata only
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
    installed = {"PYTHONPATH": str(site.parent)}
    first = cli_process("--root", str(root), "init", "--json", "--", *launch(model), env=installed)
    assert first.returncode == 0, first.stderr
    assert not [w for w in json.loads(first.stdout)["warnings"] if "not installed" in w]
    # The same server, now prepared where vLLM is not installed (an initContainer).
    out = vinit(root, launch(model), "--json")
    assert out.returncode == 0, out.stderr
    again = json.loads(out.stdout)
    assert (again["outcome"], again["ns_id"]) == ("unchanged", json.loads(first.stdout)["ns_id"])
    assert "vLLM is not installed here; using version 0.33 of the instance's namespace" in (
        out.stderr
    )


def test_an_undetectable_vllm_version_is_said_with_the_fix(root: Path, model: Path) -> None:
    out = vinit(root, launch(model))
    assert out.returncode == 0, out.stderr
    (said,) = [ln for ln in out.stderr.splitlines() if "vLLM version" in ln]
    assert "--vllm-version (e.g. 0.34.0)" in said


def test_init_says_when_the_launch_would_bypass_the_namespace(root: Path, model: Path) -> None:
    out = vinit(root, launch(model))
    (ns,) = [p for p in (root / "ns").iterdir() if p.is_dir()]
    assert f"created ns {ns.name}" in out.stdout
    assert "the launch's fs tier root_dir is /srv/kv, not the namespace dir" in out.stderr
    env = vinit(root, launch(model), "--print-env")
    lines = env.stdout.splitlines()
    assert lines[0] == f"CACHEMGR_VLLM_ROOT_DIR={ns}" and "root_dir is" not in env.stderr
    assert lines[1].startswith("CACHEMGR_VLLM_KV_TRANSFER_CONFIG='{")


@pytest.mark.parametrize("name", ["root", "kv-ü"])  # JSON writes the latter kv-\u00fc
def test_purging_a_namespace_a_running_vllm_uses_is_refused(
    tmp_path: Path, model: Path, name: str
) -> None:
    root = tmp_path / name
    first = vinit_json(root, launch(model))
    # A server started with init's command: its argv names the namespace dir (as JSON).
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()", *first["command"]],
        stdin=subprocess.PIPE,
        text=True,
    )
    try:
        out = vinit(root, launch(model, "--kv-cache-dtype", "fp8"))
        assert out.returncode == 2 and f"in use by running process {server.pid}" in (
            one_line_error(out)
        )
        assert Path(first["storage_dir"]).is_dir()
    finally:
        server.communicate("", timeout=30)
    assert vinit_json(root, launch(model, "--kv-cache-dtype", "fp8"))["old_action"] == "purged"


def test_a_vllm_config_file_that_is_missing_or_not_yaml_is_one_line(
    tmp_path: Path, model: Path
) -> None:
    root = tmp_path / "root"
    bad = tmp_path / "bad.yaml"
    bad.write_text("kv-cache-dtype: [unclosed\n")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"kv-cache-dtype: fp8\n\xff\xfe\n")  # (was a UnicodeDecodeError traceback)
    cases = [
        ("missing.yaml", 1, "No such file"),
        (str(bad), 2, "is not YAML"),
        (str(binary), 2, "is not UTF-8 text"),
        ("serve.json", 2, "reads only .yaml/.yml"),
    ]
    for path, code, says in cases:
        out = vinit(root, ["vllm", "serve", str(model), "--config", path])
        assert out.returncode == code and says in one_line_error(out), out.stderr
    assert not root.exists()


def test_a_config_file_launch_whose_model_vllm_does_not_find_is_refused_before_a_purge(
    tmp_path: Path, model: Path
) -> None:
    """vLLM looks for the positional model right after `serve` before it takes --config out:
    `serve --dtype half M --config c.yaml` and `serve --config c.yaml M` fail its start ("No
    model specified!") unless the file names one. cachemgr took M and purged the instance's
    namespace for a server that never started."""
    root = tmp_path / "root"
    good = vinit_json(root, launch(model, "--kv-cache-dtype", "fp8"))
    conf = tmp_path / "c.yaml"
    conf.write_text(f"kv_transfer_config: {json.dumps(tier_config())}\n")
    for argv in (
        ["vllm", "serve", "--dtype", "half", str(model), "--config", str(conf)],
        ["vllm", "serve", "--config", str(conf), str(model)],
    ):
        out = vinit(root, argv)
        assert out.returncode == 2 and "no model" in one_line_error(out), out.stderr
    assert Path(str(good["storage_dir"])).is_dir()  # not purged
    named = tmp_path / "named.yaml"
    named.write_text(f"model: {model}\nkv_transfer_config: {json.dumps(tier_config())}\n")
    out = vinit(root, ["vllm", "serve", "--config", str(named)])
    assert out.returncode == 0, out.stderr


# What vLLM's own classes make of a --kv-transfer-config: each connector it runs (a
# MultiConnector's children built as multi_connector.py builds them) and, for a tiering spec,
# the root_dir of each tier TieringOffloadingSpec reads.
VLLM_TIER_ROOTS = """
import json, sys
from vllm.config.kv_transfer import KVTransferConfig
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
top = KVTransferConfig(**json.loads(sys.stdin.read()))
children = [top]
if top.kv_connector == "MultiConnector":
    children = [
        KVTransferConfig(**{"engine_id": top.engine_id, **c})
        for c in top.kv_connector_extra_config["connectors"]
    ]
roots = []
for child in children:
    if child.kv_connector_extra_config.get("spec_name") == "TieringOffloadingSpec":
        extra = child.kv_connector_extra_config
        for tier, cls in TieringOffloadingSpec._get_secondary_tiers(extra):
            roots.append([child.kv_connector, cls.__name__, tier.get("root_dir")])
print(json.dumps(roots))
"""


def test_init_points_the_fs_tier_of_a_multiconnector_child(root: Path, model: Path) -> None:
    result = vinit_json(root, launch(model, config=multi_config()))
    ns_dir = str(root / "ns" / result["ns_id"])
    pointed = json.loads(result["env"]["CACHEMGR_VLLM_KV_TRANSFER_CONFIG"])
    assert pointed == multi_config(ns_dir)  # the NIXL child and everything else as given
    at = result["command"].index("--kv-transfer-config")
    assert json.loads(result["command"][at + 1]) == pointed
    manifest = json.loads((root / "ns" / f"{result['ns_id']}.json").read_text())
    assert manifest["identity"]["source"]["root_dir_arg"] == "/srv/kv"


@pytest.mark.vllm
def test_vllm_reads_the_multiconnector_tier_where_init_pointed_it(
    root: Path, model: Path, vllm_scripts: ScriptRunner
) -> None:
    result = vinit_json(root, launch(model, config=multi_config()))
    config = result["env"]["CACHEMGR_VLLM_KV_TRANSFER_CONFIG"]
    read = json.loads(vllm_scripts.run(VLLM_TIER_ROOTS, stdin=config))
    ns_dir = str(root / "ns" / result["ns_id"])
    assert read == [["OffloadingConnector", "FileSystemTierManager", ns_dir]]


def test_exec_points_a_multiconnector_child_given_by_dotted_keys(
    root: Path, model: Path, fake_vllm: dict[str, str]
) -> None:
    children = multi_config()["kv_connector_extra_config"]["connectors"]
    command = [
        *["vllm", "serve", str(model), "--kv-transfer-config.kv_connector", "MultiConnector"],
        *["--kv-transfer-config.kv_role", "kv_both"],
        *["--kv-transfer-config.kv_connector_extra_config.connectors", json.dumps(children)],
    ]
    proc = exec_fake(root, command, fake_vllm)
    (ns,) = [p for p in (root / "ns").iterdir() if p.is_dir()]
    pointed = multi_config(str(ns))["kv_connector_extra_config"]["connectors"]
    assert json.loads(json.loads(proc.stdout)[-1]) == pointed


def _nested(depth: int) -> dict[str, Any]:
    """A MultiConnector `depth` levels deep around the offloading connector."""
    config = tier_config()
    for _ in range(depth):
        config = {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [config]},
        }
    return config


def test_multiconnector_configs_vllm_would_refuse_or_never_read_are_refused(
    tmp_path: Path, model: Path
) -> None:
    bad_child = multi_config()
    bad_child["kv_connector_extra_config"]["connectors"][1]["kv_role"] = "kv_sideways"
    not_multi = tier_config()  # `connectors` means nothing to an OffloadingConnector
    not_multi["kv_connector_extra_config"] = {"connectors": [tier_config()]}
    cases = [
        (bad_child, "--kv-transfer-config connector 1: kv_role 'kv_sideways' is not one of"),
        (_nested(9), "--kv-transfer-config: connectors nested more than 8 deep"),
        (not_multi, "has no fs tier"),
    ]
    for config, message in cases:
        out = vinit(tmp_path / "root", launch(model, config=config))
        assert out.returncode == 2 and message in one_line_error(out), out.stderr
        assert not (tmp_path / "root").exists()
    assert vinit_json(tmp_path / "ok", launch(model, config=_nested(8)))["outcome"] == "created"


def _with_stale_nixl_tier() -> dict[str, Any]:
    config = multi_config()
    nixl = config["kv_connector_extra_config"]["connectors"][0]
    nixl["kv_connector_extra_config"] = {"secondary_tiers": [{"type": "fs", "root_dir": "/old"}]}
    return config


def _no_spec_name() -> dict[str, Any]:
    config = tier_config()
    del config["kv_connector_extra_config"]["spec_name"]
    return config


def _module_path_offloading() -> dict[str, Any]:
    config = _no_spec_name()
    module = "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"
    return {**config, "kv_connector_module_path": module}  # vLLM's own class: spec_name rules


def _fs_by_class() -> dict[str, Any]:
    config = tier_config()
    by_class = {
        "type": "FileSystemTierManager",
        "module_path": "vllm.v1.kv_offload.tiering.fs.manager",
        "root_dir": "/srv/other",
    }
    config["kv_connector_extra_config"]["secondary_tiers"].append(by_class)
    return config


@pytest.mark.parametrize(
    ("config", "extra", "says"),
    [
        (_no_spec_name(), [], "would not run its fs tier: no spec_name (CPUOffloadingSpec)"),
        (_module_path_offloading(), [], "no spec_name (CPUOffloadingSpec)"),
        (multi_config(), ["--kv-offloading-size", "8"], "--kv-offloading-size makes vLLM run"),
        (tier_config(), ["--kv-offloading-size", "8", "--kv-offloading-backend", "lmcache"], "run"),
        (_fs_by_class(), [], "has 2 fs tiers"),
        (
            {**tier_config(), "nest": json.loads("[" * 101 + "]" * 101)},
            [],
            "JSON nested more than 100 levels deep",
        ),
    ],
)
def test_a_tier_vllm_would_not_run_or_a_config_it_refuses_is_refused(
    tmp_path: Path, model: Path, config: dict[str, Any], extra: list[str], says: str
) -> None:
    out = vinit(tmp_path / "root", launch(model, *extra, config=config))
    assert out.returncode == 2 and says in one_line_error(out), out.stderr
    assert not (tmp_path / "root").exists()


def test_the_simple_offload_connector_from_the_environment_drops_the_tier(
    tmp_path: Path, model: Path
) -> None:
    command = ["env", "VLLM_USE_SIMPLE_KV_OFFLOAD=1", *launch(model, "--kv-offloading-size", "8")]
    out = vinit(tmp_path / "root", command)
    assert out.returncode == 2 and "its SimpleCPUOffloadConnector instead" in one_line_error(out)
    # vLLM's own connector keeps the config's extra settings: the tier still runs.
    assert vinit_json(tmp_path / "ok", launch(model, "--kv-offloading-size", "8"))["ns_id"]


def test_configs_vllm_runs_a_tier_of_are_managed(root: Path, model: Path) -> None:
    stale = vinit_json(root, launch(model, config=_with_stale_nixl_tier()))  # NIXL runs none
    ns_dir = str(root / "ns" / stale["ns_id"])
    pointed = json.loads(stale["env"]["CACHEMGR_VLLM_KV_TRANSFER_CONFIG"])
    assert pointed["kv_connector_extra_config"]["connectors"][1] == tier_config(ns_dir)
    # JSON with vLLM's human-readable numbers (`16G`), and lists nested deep beside the tier.
    raw = json.dumps({**tier_config(), "deep": json.loads("[" * 30 + "]" * 30)})
    human = raw.replace('"cpu_bytes_to_use": 1073741824', '"cpu_bytes_to_use": 16G')
    assert human != raw
    result = vinit_json(root, ["vllm", "serve", str(model), "--kv-transfer-config", human])
    config = json.loads(result["env"]["CACHEMGR_VLLM_KV_TRANSFER_CONFIG"])
    assert config["kv_connector_extra_config"]["cpu_bytes_to_use"] == 16 << 30
    assert root_dir_of(result["command"]) == str(root / "ns" / result["ns_id"])
