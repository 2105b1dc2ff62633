"""What every engine's identity computation shares: the operator's knobs, the weights'
digest, dtype spellings and the engine version's granularity."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from cachemgr.errors import IdentityError
from cachemgr.identity import hashing, model_dir
from cachemgr.identity.digest_cache import DigestCache
from cachemgr.identity.hashing import FileStat
from cachemgr.identity.record import (
    FileDigest,
)
from cachemgr.identity.record import Weights as WeightsRecord

# --load-format values that load the model dir's own weights (arg_groups/choices.py); any
# other (dummy: random weights, remote*, private, flash_rl, newer ones) is in the identity.
WEIGHT_LOAD_FORMATS = frozenset(
    """
    auto pt safetensors instanttensor npcache sharded_state presharded gguf expert_pack
    bitsandbytes mistral layered fastsafetensors runai_streamer
    """.split()  # noqa: SIM905
)
VersionGranularity = Literal["major.minor", "full", "none"]
# Opens a progress display for a number of bytes to hash; yields the per-chunk callback.
ProgressFactory = Callable[[int], AbstractContextManager[hashing.Progress | None]]

# SGLang's dtype spellings (model_config.py _STR_DTYPE_TO_TORCH_DTYPE, kv_cache_dtype.py).
_DTYPE_NAMES = {
    "bf16": "bfloat16",
    "half": "float16",
    "fp16": "float16",
    "float": "float32",
    "fp32": "float32",
    "fp8_e4m3fn": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
}


class IdentityOptions(BaseModel):
    """The operator's knobs on how an identity is computed."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    salt: str = ""
    fast: bool = False
    engine_version: str | None = None  # explicit; else the installed engine's, else "unknown"
    version_granularity: VersionGranularity = "major.minor"
    hash_workers: int = 0  # 0: hashing.default_workers()


def normalize_dtype(name: str) -> str:
    """One spelling per dtype, so `bf16` and `bfloat16` are the same identity."""
    low = name.strip().lower().removeprefix("torch.")
    return _DTYPE_NAMES.get(low, low)


def engine_version(
    explicit: str | None,
    granularity: VersionGranularity,
    installed: Callable[[], str | None],
) -> tuple[str, str | None, Literal["option", "installed", "unknown"]]:
    """(identity value, full version, where it came from) of the launch's engine."""
    full = explicit or installed()
    origin: Literal["option", "installed", "unknown"] = (
        "option" if explicit else "installed" if full else "unknown"
    )
    if granularity == "none":
        return "any", full, origin
    if full is None:
        return "unknown", None, origin
    return (".".join(full.split(".")[:2]) if granularity == "major.minor" else full), full, origin


@contextlib.contextmanager
def _no_progress(_total: int) -> Iterator[hashing.Progress | None]:
    yield None


def digest_weights(
    model: Path,
    *,
    fast: bool = False,
    cache: DigestCache | None = None,
    workers: int = 0,
    progress: ProgressFactory | None = None,
    code: bool = False,
) -> WeightsRecord:
    """Digest every identity file of a model dir (or single GGUF file), reusing cached
    digests of unchanged files."""
    directory, names = model_dir.identity_files(model, code=code)
    real = {name: Path(os.path.realpath(directory / name)) for name in names}
    stats = {name: hashing.stat_regular(directory / name) for name in names}
    for name, st in stats.items():
        if st.size == 0:
            raise IdentityError(f"{directory / name} is empty (0 bytes): an interrupted download?")
    algo = hashing.ALGO_FAST if fast else hashing.ALGO_FULL
    keyed: dict[str, FileStat] = {str(real[n]): stats[n] for n in names}
    known = cache.lookup(algo, keyed) if cache is not None else {}
    todo = sorted({real[n] for n in names if str(real[n]) not in known})
    todo_bytes = sum(keyed[str(p)].size for p in todo)
    with (progress or _no_progress)(todo_bytes) as tick:
        fresh = hashing.hash_files(todo, fast=fast, workers=workers, progress=tick)
    if cache is not None and fresh:
        cache.record(algo, {str(p): (h.stat, h.digest) for p, h in fresh.items()})
    digests = known | {str(p): h.digest for p, h in fresh.items()}
    sizes = keyed | {str(p): h.stat for p, h in fresh.items()}
    files = tuple(
        FileDigest(name=n, size=sizes[str(real[n])].size, digest=digests[str(real[n])])
        for n in names
    )
    return WeightsRecord(mode="fast" if fast else "full", algo=algo, files=files)


def model_weights(
    model: Path,
    options: IdentityOptions,
    *,
    cache: DigestCache | None,
    progress: ProgressFactory | None,
    code: bool,
) -> WeightsRecord:
    """A model dir's (or single GGUF file's) weights as every engine's identity records
    them: digested the way the operator's `options` say (fast or full, how many hashing
    threads); `code`: remote code."""
    return digest_weights(
        model,
        fast=options.fast,
        cache=cache,
        workers=options.hash_workers,
        progress=progress,
        code=code,
    )
