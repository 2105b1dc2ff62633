"""Where a model's files are and which of them decide what its KV cache pages mean."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachemgr.errors import IdentityError, ModelNotFoundError

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
    xdg = env.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    home = _expand(env.get("HF_HOME", os.path.join(xdg, "huggingface")), env)
    legacy = env.get("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub"))
    return Path(_expand(env.get("HF_HUB_CACHE", legacy), env)).absolute()


def _expand(path: str, env: Mapping[str, str]) -> str:
    """os.path.expandvars(os.path.expanduser(path)) with `env` for the process's environment."""
    return _VAR.sub(
        lambda m: env.get(m[1].removeprefix("{").removesuffix("}"), m[0]), os.path.expanduser(path)
    )


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
    repo = cache / ("models--" + path.replace("/", "--"))
    rev = revision or "main"
    if _COMMIT_RE.fullmatch(rev):
        commit = rev
    else:
        try:
            commit = (repo / "refs" / rev).read_text(encoding="ascii").strip()
        except OSError:
            raise ModelNotFoundError(
                f"model {path} is not a local directory and not in the Hugging Face cache "
                f"{cache} (no {repo.name}/refs/{rev}); download it first or pass its directory"
            ) from None
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        raise ModelNotFoundError(f"model {path}: HF cache snapshot {snapshot} is missing")
    return snapshot


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
