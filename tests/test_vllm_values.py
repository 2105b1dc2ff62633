"""The values of a vLLM launch no argparse choices check, read as vLLM 0.34.0 reads them:
VLLM_KV_CACHE_LAYOUT (refused as vLLM refuses it; NHD/LBNHC and HND/LBHNC one identity),
VLLM_USE_SIMPLE_KV_OFFLOAD (an integer; set but empty refused),
--quantization and --load-format (lowercased; one vLLM does not ship is refused unless
--plugin-value names it)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from cachemgr.errors import ConfigError
from cachemgr.vllm.args import resolve_vllm_args
from cachemgr.vllm.flags import KV_LAYOUTS, LOAD_FORMATS, QUANTIZATION_METHODS
from tests.conftest import REPO, ScriptRunner
from tests.nsfixtures import cli, cli_process, one_line_error
from tests.test_identity import make_model
from tests.vllm_launch import launch, vinit, vinit_json

LAYOUT = "VLLM_KV_CACHE_LAYOUT"
SIMPLE = "VLLM_USE_SIMPLE_KV_OFFLOAD"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return make_model(tmp_path / "model")


@pytest.mark.parametrize("value", ["hnd", "bogus", "Lbhnc", " HND"])
def test_a_layout_vllm_refuses_is_one_line_exit_2_and_the_cache_is_kept(
    root: Path, model: Path, fake_vllm: dict[str, str], value: str
) -> None:
    first = vinit_json(root, launch(model, "-q", "fp8"))
    block = root / "ns" / first["ns_id"] / "block.bin"
    block.write_bytes(b"x")
    before = sorted(p.name for p in (root / "ns").iterdir())
    for command in ("init", "exec"):
        for env, prefix in (({LAYOUT: value}, []), (fake_vllm, ["env", f"{LAYOUT}={value}"])):
            argv = [*prefix, *launch(model, "-q", "fp8")]
            out = cli("--root", str(root), command, "--", *argv, env={**fake_vllm, **env})
            said = one_line_error(out)
            assert out.returncode == 2 and f"invalid {LAYOUT}={value!r}" in said
            assert "LBNHC, LBHNC, LHBNC, NHD, HND, BLHNC, BLNHC, BHLNC" in said
    assert block.exists() and sorted(p.name for p in (root / "ns").iterdir()) == before


def test_an_empty_layout_is_refused_as_vllm_refuses_it(tmp_path: Path, model: Path) -> None:
    """vLLM's env_with_choices checks a set variable, empty or not; unset is the default."""
    root = tmp_path / "root"
    out = vinit(root, ["env", f"{LAYOUT}=", *launch(model)])
    assert out.returncode == 2 and f"invalid {LAYOUT}=''" in one_line_error(out)
    assert not root.exists()
    with pytest.raises(ConfigError, match=f"invalid {LAYOUT}=''"):
        resolve_vllm_args(launch(model), {LAYOUT: ""})
    assert resolve_vllm_args(launch(model), {}).kv_cache_layout is None


@pytest.mark.parametrize("where", ["environment", "launch"])
def test_an_empty_simple_offload_is_refused_as_vllm_refuses_it(
    root: Path, model: Path, fake_vllm: dict[str, str], where: str
) -> None:
    """vLLM reads bool(int(os.getenv(NAME, "0"))): set but empty is int(""), a ValueError when
    EngineCore reads every variable at start (envs.enable_envs_cache). cachemgr read it as 0
    and went on (init, purge) for a server that never starts. Refused before anything."""
    first = vinit_json(root, launch(model))
    block = root / "ns" / first["ns_id"] / "block.bin"
    block.write_bytes(b"x")
    before = sorted(p.name for p in (root / "ns").iterdir())
    for command in ("init", "exec"):
        argv = [*launch(model, "--kv-offloading-size", "8"), "-q", "fp8"]
        env = {**fake_vllm, SIMPLE: ""}  # a real process: `cli` unsets an empty variable
        if where == "launch":
            argv, env = ["env", f"{SIMPLE}=", *argv], fake_vllm
        out = cli_process("--root", str(root), command, "--", *argv, env=env)
        assert out.returncode == 2 and f"invalid {SIMPLE}=''" in one_line_error(out)
    assert block.exists() and sorted(p.name for p in (root / "ns").iterdir()) == before
    assert resolve_vllm_args(launch(model), {SIMPLE: "0"}).model == str(model)  # unset, too


@pytest.mark.parametrize(("old", "new"), [("NHD", "LBNHC"), ("HND", "LBHNC")])
def test_a_layouts_two_names_are_one_namespace(root: Path, model: Path, old: str, new: str) -> None:
    """vLLM reads NHD as LBNHC and HND as LBHNC (config/cache.py): renaming one must not purge
    the cache. The identity keeps the old name, so namespaces made with it keep their id."""
    first = vinit_json(root, ["env", f"{LAYOUT}={old}", *launch(model)])
    (root / "ns" / first["ns_id"] / "block.bin").write_bytes(b"x")
    again = vinit_json(root, ["env", f"{LAYOUT}={new}", *launch(model)])
    assert (again["outcome"], again["ns_id"]) == ("unchanged", first["ns_id"])
    assert (root / "ns" / first["ns_id"] / "block.bin").exists()
    assert resolve_vllm_args(launch(model), {LAYOUT: new}).kv_cache_layout == old
    other = vinit_json(root, ["env", f"{LAYOUT}=LHBNC", *launch(model)])  # a layout of its own
    assert other["outcome"] == "changed" and other["ns_id"] != first["ns_id"]


@pytest.mark.parametrize(
    ("given", "same_as"),
    [
        (["-q", "FP8"], ["-q", "fp8"]),
        (["--quantization=Compressed-Tensors"], ["-q", "compressed-tensors"]),
        (["--load-format", "SAFETENSORS"], []),
        (["--load-format", "Dummy"], ["--load-format", "dummy"]),
    ],
)
def test_quantization_and_load_format_are_lowercased_as_vllm_does(
    root: Path, model: Path, given: list[str], same_as: list[str]
) -> None:
    """vLLM 0.34.0 lowercases both (ModelConfig's and LoadConfig's validators): `-q FP8` runs
    as `-q fp8`, so it is the same cache, not a purge."""
    first = vinit_json(root, launch(model, *same_as))
    (root / "ns" / first["ns_id"] / "block.bin").write_bytes(b"x")
    again = vinit_json(root, launch(model, *given))
    assert (again["outcome"], again["ns_id"]) == ("unchanged", first["ns_id"])


def test_a_deprecated_quantization_needs_its_flag_as_vllm_does(root: Path, model: Path) -> None:
    """ModelConfig refuses fbgemm_fp8 without --allow-deprecated-quantization: init made a
    namespace and purged the instance's good one for a server that never started."""
    good = vinit_json(root, launch(model))
    out = vinit(root, launch(model, "-q", "FBGEMM_FP8"))
    assert out.returncode == 2 and "--allow-deprecated-quantization" in one_line_error(out)
    assert Path(str(good["storage_dir"])).is_dir()
    allowed = launch(model, "-q", "fbgemm_fp8", "--allow-deprecated-quantization")
    assert vinit_json(root, allowed)["outcome"] != "unchanged"
    denied = launch(model, "-q", "fbgemm_fp8", "--no-allow-deprecated-quantization")
    assert vinit(root, denied).returncode == 2


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["-q", "fp88"], "--quantization 'fp88' is not a quantization method vLLM 0.34.0 ships"),
        (["--load-format", "safetensor"], "--load-format 'safetensor' is not a load format"),
    ],
)
def test_a_value_vllm_does_not_ship_is_refused_before_anything(
    root: Path, model: Path, fake_vllm: dict[str, str], flags: list[str], says: str
) -> None:
    """ModelConfig refuses a quantization method vLLM lacks, get_model_loader a load format:
    init warned after it had made a namespace and purged the instance's good one, for a server
    that never started. Refused first, naming the nearest values and the way out."""
    good = vinit_json(root, launch(model))
    block = root / "ns" / good["ns_id"] / "block.bin"
    block.write_bytes(b"x")
    before = sorted(p.name for p in (root / "ns").iterdir())
    for command in ("init", "exec"):
        out = cli("--root", str(root), command, "--", *launch(model, *flags), env=fake_vllm)
        said = one_line_error(out)
        assert out.returncode == 2 and says in said, said
        assert f"pass --plugin-value {flags[1]}" in said
    assert "(nearest: fp8" in one_line_error(vinit(root, launch(model, "-q", "FP88")))
    assert "(nearest: safetensors" in one_line_error(
        vinit(root, launch(model, "--load-format", "safetensor"))
    )
    assert block.exists() and sorted(p.name for p in (root / "ns").iterdir()) == before


@pytest.mark.parametrize(
    "flags", [["-q", "my_plugin_quant"], ["--load-format", "My_Loader"], ["-q", "My_Plugin_Quant"]]
)
def test_a_value_a_plugin_registers_is_taken_when_init_is_told(
    root: Path, model: Path, fake_vllm: dict[str, str], flags: list[str]
) -> None:
    """A plugin may register it (register_quantization_config, register_model_loader, run
    from the vllm.general_plugins entry points as vLLM starts): --plugin-value says so. It
    is a value of its own in the identity; vLLM lowercases the launch's, so either case
    names it."""
    value = flags[1]
    result = vinit_json(root, launch(model, *flags), "--plugin-value", value.upper())
    assert result["outcome"] == "created"
    assert not [w for w in result["warnings"] if "plugin" in w or value in w]
    again = vinit_json(root, launch(model, *flags), "--plugin-value", "x", "--plugin-value", value)
    assert (again["outcome"], again["ns_id"]) == ("unchanged", result["ns_id"])
    argv = ["--root", str(root), "exec", "--plugin-value", value, "--", *launch(model, *flags)]
    out = cli_process(*argv, env=fake_vllm)
    assert out.returncode == 0 and "plugin" not in out.stderr, out.stderr
    assert json.loads(out.stdout)[2:4] == flags  # the server was started
    other = vinit_json(root, launch(model), "--plugin-value", value)  # unused: no harm
    assert other["ns_id"] != result["ns_id"]


@pytest.mark.parametrize(
    "declared",
    [
        # auto_gptq.py / auto_awq.py take `marlin` for a GPTQ / AWQ checkpoint
        {"quantization_config": {"quant_method": "gptq", "bits": 4}},
        {"quantization_config": {"quant_method": "AWQ", "bits": 4}},
        {"text_config": {"quantization_config": {"quant_method": "gptq"}}},
    ],
)
def test_marlin_on_a_gptq_or_awq_checkpoint_is_taken(
    root: Path, tmp_path: Path, fake_vllm: dict[str, str], declared: dict
) -> None:
    """vLLM's AutoGPTQ and AutoAWQ overrides map `-q marlin` from the checkpoint's own
    quantization config before checking it (ModelConfig._verify_quantization): it starts."""
    checkpoint = make_model(tmp_path / "quantized", extra_config=declared)
    assert vinit_json(root, launch(checkpoint, "-q", "marlin"))["outcome"] == "created"
    out = cli_process(
        "--root", str(root), "exec", "--", *launch(checkpoint, "-q", "marlin"), env=fake_vllm
    )
    assert out.returncode == 0, out.stderr
    # an unquantized checkpoint has no such mapping: still refused first
    plain = make_model(tmp_path / "plain")
    assert "pass --plugin-value marlin" in one_line_error(
        vinit(root, launch(plain, "-q", "marlin"))
    )


@pytest.mark.parametrize(
    ("declared", "flags", "method"),
    [
        # no override claims it: vLLM's mismatch error ends its start
        ({"quantization_config": {"quant_method": "fp8"}}, ["-q", "fp8x"], "fp8"),
        ({"quantization_config": {"quant_method": "fp8"}}, ["-q", "fp"], "fp8"),
        ({"quantization_config": {"quant_method": "awq"}}, ["--quantization=fp8x"], "awq"),
        (
            {"compression_config": {"quant_method": "compressed-tensors"}},
            ["-q", "marlin"],
            "compressed-tensors",
        ),
        # an override claims the checkpoint whatever the value: vLLM runs inc / modelopt
        (
            {"quantization_config": {"quant_method": "auto-round"}},
            ["-q", "auto-round"],
            "auto-round",
        ),
        (None, ["-q", "fp8x"], "modelopt"),  # ModelOpt's hf_quant_config.json beside config.json
    ],
)
def test_a_value_vllm_does_not_run_on_a_quantized_checkpoint_is_refused(
    root: Path, tmp_path: Path, declared: dict | None, flags: list[str], method: str
) -> None:
    """A --quantization vLLM does not ship on a checkpoint that declares its own: vLLM refuses
    the mismatch, or runs the checkpoint's method in its place. cachemgr took any such value,
    made a namespace recording it and purged the instance's good one, for a server that did
    not start or ran another method than the record said; now one line, the cache kept."""
    checkpoint = make_model(tmp_path / "quantized", extra_config=declared or {})
    if declared is None:
        (checkpoint / "hf_quant_config.json").write_text(
            '{"producer": {"name": "modelopt"}, "quant_method": "modelopt", '
            '"quantization": {"quant_algo": "FP8"}}'
        )
    good = vinit_json(root, launch(checkpoint))
    before = sorted(p.name for p in (root / "ns").iterdir())
    out = vinit(root, launch(checkpoint, *flags))
    said = one_line_error(out)
    assert out.returncode == 2 and f"the checkpoint declares {method}:" in said, said
    assert "drop the flag" in said and "--plugin-value" in said
    assert sorted(p.name for p in (root / "ns").iterdir()) == before
    # a plugin that registers it is the way out, as for an unquantized checkpoint
    value = flags[-1].partition("=")[2] or flags[-1]
    other = vinit_json(root, launch(checkpoint, *flags), "--plugin-value", value)
    assert other["ns_id"] != good["ns_id"]


# vLLM's own answer for each value: does it start with it, and what does it run with.
VLLM_READS = textwrap.dedent("""
    import json, os, sys
    import vllm.envs
    from vllm.config.cache import _layout_from_name
    from vllm.config.load import LoadConfig
    from vllm.config.model import ModelConfig
    import vllm.model_executor.layers.quantization as q
    asked = json.loads(sys.stdin.read())
    layouts = {}
    for value in asked["layouts"]:
        os.environ["VLLM_KV_CACHE_LAYOUT"] = value
        try:
            got = vllm.envs.environment_variables["VLLM_KV_CACHE_LAYOUT"]()
            layouts[value] = _layout_from_name(got).name
        except ValueError:
            layouts[value] = None
    os.environ.pop("VLLM_KV_CACHE_LAYOUT")
    quants = {}
    for value in asked["quantizations"]:
        got = ModelConfig.validate_quantization_before(value)
        quants[value] = got if got in q.QUANTIZATION_METHODS else None
    loads = {v: LoadConfig(load_format=v).load_format for v in asked["loads"]}
    print(json.dumps({"layouts": layouts, "quantizations": quants, "loads": loads}))
""")


@pytest.mark.vllm
def test_values_read_as_vllms_own_code_reads_them(vllm_scripts: ScriptRunner, model: Path) -> None:
    """Against vLLM 0.34.0's code: a layout it refuses cachemgr refuses, two it runs as one
    layout are one identity; a quantization or load format is what vLLM runs with."""
    layouts = [*KV_LAYOUTS, *(v.lower() for v in KV_LAYOUTS), "", "bogus", "HND "]
    quants = sorted(QUANTIZATION_METHODS) + [v.upper() for v in sorted(QUANTIZATION_METHODS)]
    loads = sorted(LOAD_FORMATS) + [v.upper() for v in sorted(LOAD_FORMATS)]
    asked = {"layouts": layouts, "quantizations": quants, "loads": loads}
    theirs = json.loads(vllm_scripts.run(VLLM_READS, stdin=json.dumps(asked)))

    def ours(env: dict[str, str], *flags: str) -> object:
        try:
            return resolve_vllm_args(launch(model, *flags), env)
        except ConfigError:
            return None

    same_layout: dict[str, set[str | None]] = {}
    for value in layouts:
        read = ours({LAYOUT: value})
        assert (read is None) == (theirs["layouts"][value] is None), value
        if read is not None:
            same_layout.setdefault(theirs["layouts"][value], set()).add(read.kv_cache_layout)
    assert all(len(ids) == 1 for ids in same_layout.values()), same_layout
    assert len(same_layout) == len(set(KV_LAYOUTS)) - 2  # the two aliases
    for value in quants:
        assert (
            # (allowed: the deprecated one's refusal is its own test)
            getattr(ours({}, "-q", value, "--allow-deprecated-quantization"), "quantization", None)
            == theirs["quantizations"][value]
        )
    for value in loads:
        assert (
            getattr(ours({}, "--load-format", value), "load_format", None)
            == (theirs["loads"][value])
        )


SIMPLE_READS = textwrap.dedent("""
    import json, os, sys
    import vllm.envs
    read = {}
    for value in json.loads(sys.stdin.read()):
        os.environ["VLLM_USE_SIMPLE_KV_OFFLOAD"] = value
        try:
            read[value] = vllm.envs.environment_variables["VLLM_USE_SIMPLE_KV_OFFLOAD"]()
        except ValueError:
            read[value] = None
    os.environ.pop("VLLM_USE_SIMPLE_KV_OFFLOAD")
    print(json.dumps(read))
""")


@pytest.mark.vllm
def test_simple_offload_read_as_vllms_own_code_reads_it(
    vllm_scripts: ScriptRunner, model: Path
) -> None:
    """Against vLLM 0.34.0's envs.py: what it refuses (None) cachemgr refuses; what it reads
    as on makes vLLM run its SimpleCPUOffloadConnector, which drops the fs tier."""
    values = ["", "0", "1", "2", " 1 ", "-1", "1_0", "true", "1.0", "on"]
    theirs = json.loads(vllm_scripts.run(SIMPLE_READS, stdin=json.dumps(values)))
    for value in values:
        ours: bool | None = False
        try:
            resolve_vllm_args(launch(model, "--kv-offloading-size", "8"), {SIMPLE: value})
        except ConfigError as e:
            ours = True if "SimpleCPUOffloadConnector" in str(e) else None
        assert ours == theirs[value], value


@pytest.mark.vllm
def test_flag_table_is_current(vllm_scripts: ScriptRunner) -> None:
    """cachemgr/vllm/flags.py, layouts, quantization methods and load formats included, is
    what scripts/gen_vllm_flags.py prints from the installed vLLM."""
    out = vllm_scripts.run(path=REPO / "scripts" / "gen_vllm_flags.py")
    committed = (REPO / "cachemgr" / "vllm" / "flags.py").read_text()
    assert out.strip() == committed.strip()
