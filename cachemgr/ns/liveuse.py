"""Which running processes on this host use a namespace dir as their storage dir: named in
their environment by a format's `dir_env` (SGLang's), or in their arguments by a format's
`argv_dirs` (vLLM's fs tier's root_dir in `--kv-transfer-config`).

Before `init` purges a namespace on an identity change it asks this: a live process whose
environment or arguments name the dir is a server still writing it (typically a second server
on the same root under the same instance name), and purging would destroy its cache under it.
A dir is compared as the server opens it: a relative one from the server's working dir
(/proc/PID/cwd), normalized (a trailing or doubled slash, `..`), and with symlinks resolved; a
`~` is left as the server leaves it (a literal dir name). A server that was stopped for the
restart is gone from /proc, so the common restart is not affected.
"""

from __future__ import annotations

import os
from pathlib import Path

from cachemgr.formats import FORMATS

# `VAR=` of each variable an engine's server reads its storage dir from.
DIR_ENV_PREFIXES = tuple(f"{f.dir_env}=".encode() for f in FORMATS.values() if f.dir_env)
ARGV_DIRS = tuple(f.argv_dirs for f in FORMATS.values() if f.argv_dirs)


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


def _env_dir(pid_dir: Path) -> str | None:
    """The storage dir the process's environment names (a format's `dir_env`), if any."""
    try:
        environ = (pid_dir / "environ").read_bytes()
    except OSError:
        return None  # gone, or not ours to read
    for item in environ.split(b"\0"):
        if item.startswith(DIR_ENV_PREFIXES):
            return os.fsdecode(item.partition(b"=")[2])
    return None


def _argv_dirs(pid_dir: Path) -> list[str]:
    """The storage dirs the process's arguments name (each format's `argv_dirs`)."""
    try:
        argv = [os.fsdecode(a) for a in (pid_dir / "cmdline").read_bytes().split(b"\0")]
    except OSError:
        return []
    return [d for found in ARGV_DIRS for d in found(argv)]


def live_users(ns_dir: Path, proc: Path = Path("/proc")) -> list[int]:
    """PIDs whose environment sets a format's `dir_env` to `ns_dir`, or whose arguments name
    it as a format's storage dir (a vLLM launch cachemgr pointed there), in any spelling the
    process itself resolves to it.

    This process and its ancestors are left out. Processes we may not read (other users when
    not root, other PID namespaces) are not seen: a safety net for one host, not a lock.
    """
    wants = _spellings(str(ns_dir))
    mine = _ancestors(proc, os.getpid())
    found = []
    try:
        entries = os.listdir(proc)
    except OSError:
        return []
    for name in entries:
        if not name.isdigit() or int(name) in mine:
            continue
        pid_dir = proc / name
        named = [_env_dir(pid_dir), *_argv_dirs(pid_dir)]
        for value in (_from_cwd(pid_dir, v) for v in named if v):
            if not _spellings(value).isdisjoint(wants):
                found.append(int(name))
                break
    return sorted(found)
