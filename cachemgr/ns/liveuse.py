"""Which running processes on this host use a namespace dir as their storage dir: named in
their environment by a format's `dir_env` (SGLang's), or in their arguments (vLLM's fs tier's
root_dir).

Before `init` purges a namespace on an identity change it asks this: a live process whose
environment names the dir, or one of whose arguments holds it as a JSON string (vLLM's
`--kv-transfer-config` with `"root_dir": "<dir>"`), is a server still writing it (typically a
second server on the same root under the same instance name), and purging would destroy its
cache under it. A server that was stopped for the restart is gone from /proc, so the common
restart is not affected.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cachemgr.formats import FORMATS

# `VAR=` of each variable an engine's server reads its storage dir from.
DIR_ENV_PREFIXES = tuple(f"{f.dir_env}=".encode() for f in FORMATS.values() if f.dir_env)


def _ancestors(proc: Path, pid: int) -> set[int]:
    """`pid` and its parents: a shell that exported an earlier init's env is not a server."""
    seen = set()
    while pid > 0 and pid not in seen:
        seen.add(pid)
        try:
            stat = (proc / str(pid) / "stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4, after "(comm)" and state
        except (OSError, ValueError, IndexError):
            break
    return seen


def _spellings(path: str) -> set[str]:
    """`path` as written (normalized) and with its symlinks resolved: a root reached through a
    symlinked parent (/data -> /mnt/disk1) is one dir under two names, and a server started
    under one name was not seen by an init or a GC run given the other."""
    return {os.path.normpath(os.path.abspath(path)), os.path.realpath(path)}


def _from_cwd(pid_dir: Path, value: str) -> str:
    """A relative storage dir as the process reads it: from its own working dir, not ours."""
    if not value or os.path.isabs(value):
        return value
    try:
        return os.path.join(os.readlink(pid_dir / "cwd"), value)
    except OSError:
        return value  # not ours to read: as from ours, as before


def _in_argv(pid_dir: Path, quoted: set[bytes]) -> bool:
    """Whether an argument of the process holds one of `quoted` (the dir as a JSON string)."""
    try:
        argv = (pid_dir / "cmdline").read_bytes()
    except OSError:
        return False
    return any(q in argv for q in quoted)


def live_users(ns_dir: Path, proc: Path = Path("/proc")) -> list[int]:
    """PIDs whose environment sets a format's `dir_env` to `ns_dir`, or whose arguments hold
    `"ns_dir"` (a vLLM launch cachemgr pointed there).

    This process and its ancestors are left out. Processes we may not read (other users when
    not root, other PID namespaces) are not seen: a safety net for one host, not a lock.
    """
    wants = _spellings(str(ns_dir))
    # As a JSON string: as written, and as json.dumps writes it (non-ASCII as \uXXXX).
    quoted = {os.fsencode(f'"{want}"') for want in wants} | {json.dumps(w).encode() for w in wants}
    mine = _ancestors(proc, os.getpid())
    found = []
    try:
        entries = os.listdir(proc)
    except OSError:
        return []
    for name in entries:
        if not name.isdigit() or int(name) in mine:
            continue
        try:
            environ = (proc / name / "environ").read_bytes()
        except OSError:
            continue  # gone, or not ours to read
        for item in environ.split(b"\0"):
            if item.startswith(DIR_ENV_PREFIXES):
                value = _from_cwd(proc / name, os.fsdecode(item.partition(b"=")[2]))
                if value and not _spellings(value).isdisjoint(wants):
                    found.append(int(name))
                break
        else:
            if _in_argv(proc / name, quoted):
                found.append(int(name))
    return sorted(found)
