"""A model path that is one GGUF file: SGLang serves it (GGUFModelLoader, its config from a
config.json beside it or from the file), so cachemgr fingerprints that file's content; vLLM
has no GGUF loader, and the refusal says so."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cachemgr.errors import ConfigError, IdentityError, ModelNotFoundError
from cachemgr.identity.hashing import ALGO_FULL, hash_file
from cachemgr.sglang.record import Identity
from cachemgr.vllm.args import resolve_vllm_args
from cachemgr.vllm.identity import compute_vllm_identity
from tests.conftest import ScriptRunner
from tests.nsfixtures import cli, one_line_error
from tests.test_identity import age, ident, make_model
from tests.test_init import CMD, NO_STORAGE_ENV
from tests.vllm_launch import launch as vllm_launch


def gguf(path: Path, body: bytes) -> Path:
    path.write_bytes(b"GGUF" + body)
    return path


@pytest.fixture
def quants(tmp_path: Path) -> Path:
    """A dir of GGUF quantizations of one model, with its config.json, as Hub repos have."""
    repo = tmp_path / "repo"
    repo.mkdir()
    gguf(repo / "m-Q4_K_M.gguf", b"q4" * 100)
    gguf(repo / "m-Q8_0.gguf", b"q8" * 100)
    (repo / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    age(repo)
    return repo


def served(path: Path, *flags: str) -> Identity:
    return ident(" ".join(["--model-path", str(path), *flags]))


def test_sglang_fingerprints_the_file_and_the_config_beside_it(
    quants: Path, tmp_path: Path
) -> None:
    q4 = served(quants / "m-Q4_K_M.gguf")
    assert [f.name for f in q4.weights.files] == ["config.json", "m-Q4_K_M.gguf"]
    digest = hash_file(quants / "m-Q4_K_M.gguf").digest
    assert (q4.weights.algo, q4.weights.files[1].digest) == (ALGO_FULL, digest)
    assert (q4.dtype, q4.source.model_dir) == ("bfloat16", str(quants / "m-Q4_K_M.gguf"))
    # the same digest as a model dir holding just that file and config.json
    alone = tmp_path / "alone"
    alone.mkdir()
    for name in ("m-Q4_K_M.gguf", "config.json"):
        (alone / name).write_bytes((quants / name).read_bytes())
    assert served(alone).weights == q4.weights
    # another quantization is another namespace; editing it does not touch this one
    assert served(quants / "m-Q8_0.gguf").ns_id != q4.ns_id
    gguf(quants / "m-Q8_0.gguf", b"other")
    assert served(quants / "m-Q4_K_M.gguf").ns_id == q4.ns_id
    gguf(quants / "m-Q4_K_M.gguf", b"edited")
    assert served(quants / "m-Q4_K_M.gguf").ns_id != q4.ns_id


def test_a_gguf_file_without_a_config_keeps_auto_dtype_unresolved(tmp_path: Path) -> None:
    """Its config is in the file's metadata (dtype, model_type: gemma runs in bf16), which
    cachemgr does not read: `auto` must not be taken for float16 and share its namespace."""
    file = gguf(tmp_path / "model.gguf", b"x" * 64)
    auto = served(file)
    assert (auto.dtype, auto.kv_cache_dtype) == ("auto", "auto")
    assert served(file, "--dtype float16").ns_id != auto.ns_id
    assert served(file, "--load-format gguf").ns_id == auto.ns_id


def test_only_what_sglang_reads_as_gguf_is_a_model_file(tmp_path: Path) -> None:
    """check_gguf_file: named *.gguf, or starting with the magic; another load format
    loads no file."""
    magic = gguf(tmp_path / "model.bin", b"x" * 64)
    assert [f.name for f in served(magic).weights.files] == ["model.bin"]
    other = tmp_path / "weights.safetensors"
    other.write_bytes(b"not gguf")
    for path, flags in ((other, ""), (magic, "--load-format safetensors")):
        with pytest.raises(IdentityError, match="is not a directory"):
            served(path, flags)


def test_init_makes_a_namespace_for_a_gguf_file(quants: Path, tmp_path: Path) -> None:
    launch = [*CMD.split(), "--model-path", str(quants / "m-Q4_K_M.gguf")]
    out = cli("--root", str(tmp_path / "root"), "init", "--json", "--", *launch, env=NO_STORAGE_ENV)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["outcome"] == "created"


def test_vllm_refuses_a_gguf_file_saying_why(quants: Path, tmp_path: Path) -> None:
    file = str(quants / "m-Q4_K_M.gguf")
    with pytest.raises(IdentityError, match=r"single GGUF file: vLLM .* has no GGUF loader"):
        compute_vllm_identity(resolve_vllm_args(vllm_launch(file), {}), env={})
    out = cli("--root", str(tmp_path / "root"), "init", "--", *vllm_launch(file))
    assert out.returncode == 2 and "single GGUF file" in one_line_error(out)


COMMIT = "c" * 40


def hub_repo(hub: Path, repo: str, files: dict[str, bytes]) -> Path:
    """An HF hub cache holding `repo` at refs/main with `files` (paths inside the repo)."""
    entry = hub / ("models--" + repo.replace("/", "--"))
    snapshot = entry / "snapshots" / COMMIT
    for name, body in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_bytes(body)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(COMMIT)
    age(snapshot)
    return snapshot


def in_hub(hub: Path, launch: str) -> Identity:
    return ident(launch, env={"HF_HUB_CACHE": str(hub)})


def test_a_gguf_repo_id_is_served_as_its_one_file(tmp_path: Path) -> None:
    """resolve_hf_gguf_reference: a repo without config.json and with one .gguf is that file,
    its config in the file's metadata (gemma runs in bf16, others fp16): `auto` stays
    unresolved, never float16's namespace."""
    hub = tmp_path / "hub"
    snapshot = hub_repo(hub, "o/gemma-gguf", {"gemma-Q4_K_M.gguf": b"GGUF" + b"g" * 64})
    auto = in_hub(hub, "--model-path o/gemma-gguf")
    assert (auto.dtype, auto.source.model_dir) == ("auto", str(snapshot / "gemma-Q4_K_M.gguf"))
    assert in_hub(hub, "--model-path o/gemma-gguf --dtype float16").ns_id != auto.ns_id
    # the same file named as a local path, or as owner/repo/<file> or owner/repo:QUANT
    assert served(snapshot / "gemma-Q4_K_M.gguf").ns_id == auto.ns_id
    assert in_hub(hub, "--model-path o/gemma-gguf/gemma-Q4_K_M.gguf").ns_id == auto.ns_id
    assert in_hub(hub, "--model-path o/gemma-gguf:Q4_K_M").ns_id == auto.ns_id
    assert in_hub(hub, "--model-path o/gemma-gguf/").ns_id == auto.ns_id  # as SGLang strips it


def test_gguf_references_in_a_repo_of_many(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    files = {"m-Q4_K_M.gguf": b"GGUF4", "sub/m-Q8_0.gguf": b"GGUF8", "m-Q8_0.txt": b"x"}
    snapshot = hub_repo(hub, "o/many", files)
    q8 = in_hub(hub, "--model-path o/many:Q8_0")
    assert q8.source.model_dir == str(snapshot / "sub" / "m-Q8_0.gguf")
    assert in_hub(hub, "--model-path o/many/sub/m-Q8_0.gguf").ns_id == q8.ns_id
    # SGLang refuses a repo of several .gguf files and no config.json: name one
    with pytest.raises(ConfigError, match=r"2 \.gguf files and no config.json.*o/many/<file>"):
        in_hub(hub, "--model-path o/many")


def test_a_repo_with_a_config_stays_a_model_dir(quants: Path, tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    files = {n: (quants / n).read_bytes() for n in ("m-Q4_K_M.gguf", "config.json")}
    snapshot = hub_repo(hub, "o/with-config", files)
    assert in_hub(hub, "--model-path o/with-config").source.model_dir == str(snapshot)


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("o/absent:Q4_K_M", r"no models--o--absent/refs/main\); download its \*-Q4_K_M.gguf"),
        ("o/r:Q5_K_M", r"no \*-Q5_K_M.gguf in the HF cache snapshot .*; download it first$"),
        ("o/r/m-Q5_K_M.gguf", r"m-Q5_K_M.gguf is not in the HF cache snapshot .*; download it"),
    ],
)
def test_a_gguf_reference_not_downloaded_is_not_found(
    tmp_path: Path, reference: str, message: str
) -> None:
    hub = tmp_path / "hub"
    hub_repo(hub, "o/r", {"m-Q4_K_M.gguf": b"GGUF4"})
    with pytest.raises(ModelNotFoundError, match=message) as e:
        in_hub(hub, f"--model-path {reference}")
    assert "pass its directory" not in str(e.value)


def test_a_gguf_draft_is_read_as_the_target_is(quants: Path, tmp_path: Path) -> None:
    """The draft runner loads with the target's resolved load format (gguf for a GGUF
    target) unless --speculative-draft-load-format says otherwise; a .gguf draft is its file."""
    draft = gguf(tmp_path / "draft.gguf", b"d" * 64)
    target = quants / "m-Q4_K_M.gguf"
    spec = f"--speculative-algorithm EAGLE --speculative-draft-model-path {draft}"
    rec = served(target, spec)
    assert rec.source.draft_model_dir == str(draft)
    assert [f.name for f in rec.draft_weights.files] == ["draft.gguf"]  # type: ignore[union-attr]
    assert rec.draft_kv_cache_dtype == "auto"  # its dtype is in the file's metadata
    gguf(draft, b"edited")
    assert served(target, spec).ns_id != rec.ns_id
    # a model dir target loads its draft as GGUF only when told to
    plain = make_model(tmp_path / "plain")
    assert served(plain, spec, "--speculative-draft-load-format gguf").draft_weights is not None
    with pytest.raises(
        ConfigError, match=r"load format auto: add --speculative-draft-load-format gguf"
    ):
        served(plain, spec)


def test_a_gguf_draft_by_hub_reference(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    hub_repo(hub, "o/target", {"t.gguf": b"GGUFt"})
    snapshot = hub_repo(hub, "o/draft", {"d-Q8_0.gguf": b"GGUFd"})
    spec = "--speculative-algorithm EAGLE --speculative-draft-model o/draft:Q8_0"
    rec = in_hub(hub, f"--model-path o/target {spec}")
    assert rec.source.draft_model_dir == str(snapshot / "d-Q8_0.gguf")


@pytest.mark.parametrize(
    "offline", [{"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "yes"}]
)
def test_offline_a_reference_sglang_must_list_the_hub_for_is_refused(
    tmp_path: Path, offline: dict[str, str]
) -> None:
    """Offline, huggingface_hub refuses every Hub request: SGLang's `owner/repo:QUANT` listing
    fails its start, and `owner/repo` falls back to a model dir without config.json. cachemgr
    had read both from the cache and made the namespace (purging the instance's good one) for
    a server that does not start. A file named in full comes from the cache, as online."""
    hub = tmp_path / "hub"
    snapshot = hub_repo(hub, "o/r", {"m-Q4_K_M.gguf": b"GGUF4"})
    env = {"HF_HUB_CACHE": str(hub), **offline}
    for reference in ("o/r:Q4_K_M", "o/r"):
        with pytest.raises(ConfigError, match=r"OFFLINE is set.*name the file as o/r/<file>.gguf"):
            ident(f"--model-path {reference}", env=env)
    named = ident("--model-path o/r/m-Q4_K_M.gguf", env=env)
    assert named.source.model_dir == str(snapshot / "m-Q4_K_M.gguf")
    assert in_hub(hub, "--model-path o/r:Q4_K_M").ns_id == named.ns_id  # online: the same file
    assert ident("--model-path o/r:Q4_K_M", env={**env, "HF_HUB_OFFLINE": "0"}).ns_id == named.ns_id
    # a repo with a config.json is a model dir offline too
    hub_repo(hub, "o/dir", {"m-Q4_K_M.gguf": b"GGUF4", "config.json": b"{}"})
    assert ident("--model-path o/dir", env=env).source.model_dir.endswith(COMMIT)


def test_init_offline_refuses_a_quant_reference_and_keeps_the_cache(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    hub_repo(hub, "o/r", {"m-Q4_K_M.gguf": b"GGUF4"})
    root = tmp_path / "root"
    env = {**NO_STORAGE_ENV, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}

    def init(model: str) -> subprocess.CompletedProcess[str]:
        argv = [*CMD.split(), "--model-path", model]
        return cli("--root", str(root), "init", "--json", "--", *argv, env=env)

    good = init("o/r/m-Q4_K_M.gguf")
    assert good.returncode == 0, good.stderr
    block = root / "ns" / json.loads(good.stdout)["ns_id"] / "block.bin"
    block.write_bytes(b"x")
    before = sorted(p.name for p in (root / "ns").iterdir())
    out = init("o/r:Q4_K_M")
    assert out.returncode == 2 and "HF_HUB_OFFLINE is set" in one_line_error(out)
    assert block.exists() and sorted(p.name for p in (root / "ns").iterdir()) == before


HUB_OFFLINE = """
import json, sys
import huggingface_hub
from huggingface_hub import constants, hf_hub_download, HfApi
hub, repo, name = json.loads(sys.stdin.read())
constants.HF_HUB_OFFLINE = True  # what HF_HUB_OFFLINE=1 sets as huggingface_hub is imported
try:
    try:
        HfApi().repo_info(repo)
        listing = "listed"
    except Exception as e:
        listing = type(e).__name__
    print(json.dumps([listing, hf_hub_download(repo, name, cache_dir=hub)]))
finally:
    constants.HF_HUB_OFFLINE = False
"""


@pytest.mark.vllm
def test_offline_huggingface_hub_lists_nothing_and_downloads_from_the_cache(
    vllm_scripts: ScriptRunner, tmp_path: Path
) -> None:
    """The premise, against huggingface_hub itself (the one vLLM's env installs; SGLang's calls
    are the same: HfApi().repo_info, hf_hub_download): offline, listing a repo raises, and a
    file named in full is the cache's, the file cachemgr reads."""
    hub = tmp_path / "hub"
    snapshot = hub_repo(hub, "o/r", {"m-Q4_K_M.gguf": b"GGUF4"})
    asked = json.dumps([str(hub), "o/r", "m-Q4_K_M.gguf"])
    listing, downloaded = json.loads(vllm_scripts.run(HUB_OFFLINE, stdin=asked))
    assert listing == "OfflineModeIsEnabled"
    named = ident("--model-path o/r/m-Q4_K_M.gguf", env={"HF_HUB_CACHE": str(hub)})
    assert downloaded == named.source.model_dir == str(snapshot / "m-Q4_K_M.gguf")


def test_a_directory_loaded_as_gguf_is_refused(quants: Path, tmp_path: Path) -> None:
    """GGUFModelLoader takes one file and raises "is not a file" for a dir (loader.py
    `_prepare_weights`), after SGLang has read the dir's config.json: the server does not
    start, so init must not make its namespace (it had hashed every .gguf in the dir)."""
    with pytest.raises(ConfigError, match=r"--model-path .* is a directory, and SGLang's GGUF"):
        served(quants, "--load-format gguf")
    assert served(quants / "m-Q8_0.gguf", "--load-format gguf").source.model_dir.endswith(".gguf")
    # a draft dir its runner loads as GGUF: told so, or by a GGUF target's resolved load format
    plain = make_model(tmp_path / "plain")
    draft = f"--speculative-algorithm EAGLE --speculative-draft-model-path {plain}"
    for target, flags in (
        (quants / "m-Q8_0.gguf", draft),
        (plain, f"{draft} --speculative-draft-load-format gguf"),
    ):
        with pytest.raises(ConfigError, match=r"--speculative-draft-model-path .* is a directory"):
            served(target, flags)
    argv = [*CMD.split(), "--model-path", str(quants), "--load-format", "gguf"]
    out = cli("--root", str(tmp_path / "root"), "init", "--", *argv, env=NO_STORAGE_ENV)
    assert out.returncode == 2 and "is a directory" in one_line_error(out)
