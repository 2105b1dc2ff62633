"""The engine's version as the launch's own Python sees it.

`make install` puts SGLang (or vLLM) in a venv of its own, so the engine is usually not
importable by cachemgr. The launch names its interpreter: `/v/bin/python -m sglang.launch_server
…`, or an entry point (`sglang`, `vllm`) whose shebang names one. That interpreter is asked, in a
subprocess, for the distribution's version with importlib.metadata; the engine itself is never
imported (vLLM's import takes ~10 s). The answer is kept in the digest cache under the
interpreter's path and stat, and it holds while the dir the distribution was found in keeps its
mtime: a pip upgrade inside the venv changes that dir, not the interpreter.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cachemgr.identity.digest_cache import DigestCache
from cachemgr.identity.hashing import FileStat
from cachemgr.launchenv import ASSIGN, split_env

log = logging.getLogger(__name__)

ASK_TIMEOUT = 10.0  # a cold venv on a slow disk; the usual answer takes ~0.1 s
_PYTHON = re.compile(r"python(\d+(\.\d+)*)?")
# pip's launcher for an interpreter path too long for a shebang: `#!/bin/sh` then this line.
_TRAMPOLINE = re.compile(r"'''exec' '?([^' ]+)")
_ASK = (
    "import importlib.metadata as m, sys\n"
    "d = m.distribution(sys.argv[1])\n"
    "print(d.version)\n"
    "print(d.locate_file(''))\n"
)
_ALGO = "engine-version:"  # the digest cache's algo column: this is no file digest


@dataclass(frozen=True)
class LaunchPython:
    """The interpreter a launch runs, and the environment it runs with."""

    path: Path
    environ: Mapping[str, str]


def launch_python(command: Sequence[str], environ: Mapping[str, str]) -> LaunchPython | None:
    """The Python that `command` runs: its program if that is a python, else the one its
    shebang names (`env VAR=1` in front applied); None if it names none."""
    tokens = list(command)
    assigned, i = split_env(tokens)
    env = {**environ, **assigned}
    program = _which(tokens[i], env) if i < len(tokens) else None
    if program is None:
        return None
    python = program if _PYTHON.fullmatch(program.name) else _shebang_python(program, env)
    return LaunchPython(python, env) if python is not None else None


def _which(name: str, env: Mapping[str, str]) -> Path | None:
    found = shutil.which(name, path=env.get("PATH", os.defpath))
    return Path(os.path.abspath(found)) if found else None


def _shebang_python(program: Path, env: Mapping[str, str]) -> Path | None:
    try:
        with open(program, "rb") as f:
            head = f.read(1024).decode(errors="replace").splitlines()
    except OSError:
        return None
    if not head or not head[0].startswith("#!"):
        return None
    words = head[0][2:].split()
    trampoline = _TRAMPOLINE.match(head[1]) if len(head) > 1 else None
    if trampoline:
        words = [trampoline[1]]
    if words and os.path.basename(words[0]) == "env":
        # `env -S python3 -u`, `env -S PYTHONUNBUFFERED=1 python3`: env's options and the
        # assignments it makes come before the program
        words = [w for w in words[1:] if not w.startswith("-") and not ASSIGN.fullmatch(w)]
        return _which(words[0], env) if words and _PYTHON.fullmatch(words[0]) else None
    if words and _PYTHON.fullmatch(os.path.basename(words[0])):
        return Path(words[0])
    return None


def installed_version(
    python: LaunchPython, dist: str, cache: DigestCache | None = None
) -> str | None:
    """The version of `dist` installed for `python`, None if it has none or cannot say."""
    key = str(python.path)
    if python.environ.get("PYTHONPATH"):
        key += f"\0{python.environ['PYTHONPATH']}"  # another path: another answer
    try:
        stat = FileStat.of(os.stat(python.path))
    except OSError:
        return None
    algo = _ALGO + dist
    if cache is not None:
        version = _still_valid(cache.lookup(algo, {key: stat}).get(key))
        if version is not None:
            return version
    answer = _ask(python, dist)
    if answer is None:
        return None
    version, site = answer
    if cache is not None:
        cache.record(algo, {key: (stat, f"{version}\t{site}\t{_mtime_ns(site)}")})
    return version


def _still_valid(cached: str | None) -> str | None:
    if cached is None:
        return None
    version, site, mtime_ns = cached.split("\t")
    return version if str(_mtime_ns(site)) == mtime_ns else None


def _mtime_ns(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1


def _ask(python: LaunchPython, dist: str) -> tuple[str, str] | None:
    """(version, the dir it was found in) from the interpreter itself."""
    try:
        out = subprocess.run(
            [str(python.path), "-c", _ASK, dist],
            capture_output=True,
            text=True,
            env=dict(python.environ),
            timeout=ASK_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        where = {"python": str(python.path), "dist": dist, "error": str(e)}
        log.warning("cannot ask the launch's python for its version", extra=where)
        return None
    lines = out.stdout.splitlines()
    if out.returncode != 0 or len(lines) < 2:
        where = {"python": str(python.path), "dist": dist}
        log.debug("the launch's python has no such distribution", extra=where)
        return None
    return lines[0].strip(), lines[1].strip()
