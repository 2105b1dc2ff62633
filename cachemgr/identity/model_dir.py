"""Where a model's files are and which of them decide what its KV cache pages mean."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachemgr.errors import ConfigError, IdentityError, ModelNotFoundError

# Weight file suffixes: what SGLang's loaders glob (model_loader/loader.py: *.safetensors, *.bin,
# *.pt; gguf files by path) plus the other common checkpoint formats, to err on the safe side.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".npz", ".msgpack")
# Configs that change how weights are interpreted. Tokenizer files, generation_config.json,
# README and *.index.json (a map the shards already determine) do not change a page's bytes.
CONFIG_FILES = frozenset(
    {
        "config.json",
        "params.json",
        "quantize_config.json",
        "quant_config.json",
        "quantization_config.json",
        "hf_quant_config.json",
    }
)
_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
GGUF_MAGIC = b"GGUF"
_VAR = re.compile(r"\$(\w+|\{[^}]*\})", re.ASCII)  # what posixpath.expandvars expands


def hf_hub_cache(env: Mapping[str, str]) -> Path:
    """The Hugging Face hub cache dir of a server whose environment is `env`, resolved as
    huggingface_hub's constants.py resolves it: a variable set but empty is taken as given (a
    path relative to the working dir, which `exec` keeps), not as unset; `~` and `$VAR`s in
    HF_HOME and HF_HUB_CACHE are expanded."""
    xdg = env.get("XDG_CACHE_HOME", os.path.join(_expanduser("~", env), ".cache"))
    home = _expand(env.get("HF_HOME", os.path.join(xdg, "huggingface")), env)
    legacy = env.get("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub"))
    return Path(_expand(env.get("HF_HUB_CACHE", legacy), env)).absolute()


def _expand(path: str, env: Mapping[str, str]) -> str:
    """os.path.expandvars(os.path.expanduser(path)) with `env` for the process's environment."""
    return _VAR.sub(
        lambda m: env.get(m[1].removeprefix("{").removesuffix("}"), m[0]), _expanduser(path, env)
    )


def _expanduser(path: str, env: Mapping[str, str]) -> str:
    """os.path.expanduser(path) with the server's HOME (`env`): a launch's `HOME=…` prefix, or
    a server run as another user, has its own `~`. Without HOME, the passwd entry, as posixpath."""
    home = env.get("HOME")
    if home is None or not (path == "~" or path.startswith("~/")):
        return os.path.expanduser(path)
    return (home.rstrip("/") + path[1:]) or "/"


def hub_offline(env: Mapping[str, str]) -> str | None:
    """The variable that makes huggingface_hub run offline in `env`, if one does (its
    constants.py: HF_HUB_OFFLINE, else TRANSFORMERS_OFFLINE, read true): every request to the
    Hub (listing a repo) then raises; files come from the cache alone."""
    name = "HF_HUB_OFFLINE" if env.get("HF_HUB_OFFLINE") else "TRANSFORMERS_OFFLINE"
    on = env.get(name, "").upper() in ("1", "ON", "YES", "TRUE")
    return name if on else None


def _looks_like_repo_id(path: str) -> bool:
    return not path.startswith(("/", ".", "~")) and 0 < path.count("/") <= 1


@dataclass(frozen=True)
class Hub:
    """Where a server finds a model it is given by repo id."""

    env: Mapping[str, str]  # the server's environment (the launch's `VAR=…` prefix included)
    # Its engine's --download-dir, which both SGLang's and vLLM's loaders hand huggingface_hub
    # as `cache_dir`: it replaces the hub cache the environment names.
    download_dir: str | None = None
    modelscope: str | None = None  # the variable that makes it download from ModelScope, if set


def locate_model(path: str, revision: str | None, hub: Hub) -> Path:
    """The local directory of `path`: the directory itself, or its HF cache snapshot."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local.absolute()
    if local.exists():
        raise IdentityError(f"model path {path} is not a directory")
    if not _looks_like_repo_id(path):
        raise ModelNotFoundError(f"model directory {path} does not exist")
    if hub.modelscope:
        # ModelScope's cache is laid out by its own client's version (and renames ids); a
        # copy of the same id in the HF cache may be other weights: neither is safe to read.
        raise ModelNotFoundError(
            f"{hub.modelscope} is set: the server downloads {path} from ModelScope, whose cache "
            "cachemgr does not read; pass the model's local directory instead of its id"
        )
    cache = Path(hub.download_dir).expanduser() if hub.download_dir else hf_hub_cache(hub.env)
    return _snapshot(path, revision, cache, "download it first or pass its directory")


def _snapshot(repo_id: str, revision: str | None, cache: Path, advice: str) -> Path:
    """The HF cache snapshot of `repo_id` at `revision`; ModelNotFoundError ending in `advice`
    if the cache does not hold it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    rev = revision or "main"
    if _COMMIT_RE.fullmatch(rev):
        commit = rev
    else:
        try:
            commit = (repo / "refs" / rev).read_text(encoding="ascii").strip()
        except OSError:
            raise ModelNotFoundError(
                f"model {repo_id} is not a local directory and not in the Hugging Face cache "
                f"{cache} (no {repo.name}/refs/{rev}); {advice}"
            ) from None
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        raise ModelNotFoundError(f"model {repo_id}: HF cache snapshot {snapshot} is missing")
    return snapshot


def hub_gguf(path: str, revision: str | None, hub: Hub) -> Path | None:
    """The .gguf file SGLang serves for a Hub reference, read from the HF cache (hf_transformers/
    common.py `resolve_hf_gguf_reference`): `owner/repo/<file>.gguf` that file, `owner/repo:Q`
    the repo's one `*-Q.gguf`, `owner/repo` its one .gguf when it has no config.json; None for
    a path that is no such reference (then it is a directory or repo id as before).

    SGLang lists the repo on the Hub; cachemgr has its snapshot, which holds what the server
    downloaded. huggingface_hub downloads the file into the environment's hub cache (SGLang
    passes no cache_dir: --download-dir does not count). Under ModelScope, locate_model says
    why the path is not read. Offline (`hub_offline`) SGLang cannot list a repo: `owner/repo:Q`
    fails its start, and `owner/repo` is a repo id again (its listing error is swallowed), so
    both are refused here unless the repo is a model dir; a file by name is read from the cache.
    """
    if not path or os.path.exists(path) or hub.modelscope or "://" in path[1:]:
        return None  # (a `<scheme>://` path is a remote URL to SGLang's is_remote_url)
    cache = hf_hub_cache(hub.env)
    offline = hub_offline(hub.env)
    if ":" in path:
        if offline and _quant_reference(path):
            raise ConfigError(
                f"model {path}: {offline} is set, and SGLang finds a *-QUANT.gguf by listing "
                "the repo on the Hub, so it would fail to start; name the file as "
                f"{path.rpartition(':')[0]}/<file>.gguf"
            )
        return _quant_gguf(path, revision, cache)
    parts = path.strip("/").split("/")
    if len(parts) > 2 and path.endswith(".gguf"):
        repo_id, name = "/".join(parts[:2]), "/".join(parts[2:])
        file = _snapshot(repo_id, revision, cache, f"download {name} first") / name
        if not file.is_file():
            raise ModelNotFoundError(
                f"model {path}: {name} is not in the HF cache snapshot {file.parent}; "
                "download it first"
            )
        return file
    if len(parts) != 2:
        return None
    repo_id = "/".join(parts)
    try:
        snapshot = _snapshot(repo_id, revision, cache, "")
    except ModelNotFoundError:
        return None  # not downloaded there: a repo id, as locate_model reads it
    if (snapshot / "config.json").exists():
        return None
    found = _gguf_names(snapshot, ".gguf")
    if offline and found:
        raise ConfigError(
            f"model {path}: {offline} is set, so SGLang cannot list the repo to find its "
            "GGUF file and reads it as a model directory, which has no config.json; name the "
            f"file as {repo_id}/<file>.gguf"
        )
    if len(found) > 1:
        raise ConfigError(
            f"model {path} has {len(found)} .gguf files and no config.json: SGLang refuses it; "
            f"name the one to serve as {repo_id}/<file>.gguf"
        )
    return snapshot / found[0] if found else None


def _quant_reference(path: str) -> bool:
    """Whether `path` has the `owner/repo:QUANT` form SGLang reads as a GGUF reference."""
    repo_id, _, quant = path.rpartition(":")
    return repo_id.count("/") == 1 and bool(quant)


def _quant_gguf(path: str, revision: str | None, cache: Path) -> Path | None:
    """`owner/repo:QUANT`: the repo's one file named *-QUANT.gguf."""
    if not _quant_reference(path):
        return None
    repo_id, _, quant = path.rpartition(":")
    suffix = f"-{quant}.gguf"
    snapshot = _snapshot(repo_id, revision, cache, f"download its *{suffix} first")
    found = _gguf_names(snapshot, suffix)
    if not found:
        raise ModelNotFoundError(
            f"model {path}: no *{suffix} in the HF cache snapshot {snapshot}; download it first"
        )
    if len(found) > 1:
        raise ConfigError(
            f"model {path}: {len(found)} files match *{suffix}, SGLang refuses it; "
            f"name the one to serve as {repo_id}/<file>.gguf"
        )
    return snapshot / found[0]


def _gguf_names(snapshot: Path, suffix: str) -> list[str]:
    """The snapshot's files (any depth, as the Hub lists a repo) whose names end in `suffix`."""
    return sorted(str(f.relative_to(snapshot)) for f in snapshot.rglob(f"*{suffix}") if f.is_file())


def gguf_file(path: str) -> Path | None:
    """`path` as a single GGUF checkpoint file, told as SGLang tells one (hf_transformers/
    common.py `check_gguf_file`: a file named *.gguf, or one that starts with the GGUF
    magic); None for anything else."""
    local = Path(path).expanduser()
    if not local.is_file():
        return None
    if local.suffix != ".gguf":
        try:
            with local.open("rb") as f:
                if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
                    return None
        except OSError:
            return None  # not one cachemgr can tell: locate_model says what the path is
    return local.absolute()


def _listdir(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError as e:
        raise IdentityError(f"cannot list model directory {directory}: {e.strerror or e}") from e


def identity_files(model: Path, *, code: bool = False) -> tuple[Path, list[str]]:
    """The directory a model's weight and config files are in, and their names: the top
    level of a model dir, as SGLang loads it, or a single GGUF file (`gguf_file`) and what
    is read beside it.

    With `code` (the server runs with --trust-remote-code) the model's own `*.py` files
    (modeling_*.py, configuration_*.py, …) count too: they compute the KV a page holds.

    Entries are matched by name, not type, so a broken symlink or a directory named like a
    shard is reported when it is hashed instead of being silently left out.
    """
    if model.is_file():
        return model.parent, _gguf_files(model, code)
    names = _listdir(model)
    chosen = sorted(
        n
        for n in names
        if not n.startswith(".")
        and (n in CONFIG_FILES or n.endswith(WEIGHT_SUFFIXES) or (code and n.endswith(".py")))
    )
    if not any(n.endswith(WEIGHT_SUFFIXES) for n in chosen):
        raise IdentityError(
            f"no weight files ({', '.join('*' + s for s in WEIGHT_SUFFIXES)}) in {model}"
        )
    if "config.json" not in chosen and not any(n.endswith(".gguf") for n in chosen):
        raise IdentityError(f"no config.json in {model}")
    return model, chosen


def _gguf_files(gguf: Path, code: bool) -> list[str]:
    """A single GGUF file's identity files: the file (not the other quantizations often
    beside it), and a config.json beside it, which SGLang's get_config reads instead of
    the file's own metadata (hf_transformers/config.py), with the code it may name."""
    beside = _listdir(gguf.parent)
    read = [n for n in beside if n == "config.json" or (code and n.endswith(".py"))]
    return sorted({gguf.name, *read})


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; {} if absent, IdentityError if unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IdentityError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise IdentityError(f"{path} is not a JSON object")
    return data


def config_dtype(config: Mapping[str, Any]) -> str | None:
    """The checkpoint's dtype: `dtype` (new transformers) or `torch_dtype`, else its text part."""
    for cfg in (config, config.get("text_config") or {}):
        value = cfg.get("dtype") or cfg.get("torch_dtype")
        if isinstance(value, str):
            return value
    return None


def kv_cache_quant_algo(model_dir: Path, config: Mapping[str, Any]) -> str | None:
    """A checkpoint's own KV quantization (e.g. modelopt's "FP8"), which `auto` KV adopts."""
    qcfg = config.get("quantization_config") or {}
    algo = qcfg.get("kv_cache_quant_algo") if isinstance(qcfg, dict) else None
    if algo is None:
        modelopt = read_json(model_dir / "hf_quant_config.json").get("quantization") or {}
        algo = modelopt.get("kv_cache_quant_algo") if isinstance(modelopt, dict) else None
    return algo if isinstance(algo, str) else None
