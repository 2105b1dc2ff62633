"""The file `cachemgr init --env-file` writes, and whether what is at its path may be replaced.

The path is often one other tools own too (systemd's EnvironmentFile=, the operator's env file
that holds SGLANG_ARGS), and the atomic rename replaced whatever was there without a word: a
device node, someone's config. Only a file init wrote is replaced now: one whose first line
is init's header, or one in the exact shape init wrote before it had a header (lines
`NAME=value`, NAME a variable an engine's server reads, the value as shlex.quote gives it).
An empty file holds nothing to lose (a placeholder made beforehand): replaced too.
"""

from __future__ import annotations

import os
import shlex
import stat
from pathlib import Path

from cachemgr import engines
from cachemgr.errors import ConfigError
from cachemgr.layout import Layout

MARK = "# written by `cachemgr init`"  # how a file of init's starts (its first line's start)
HEADER = f"{MARK} (replaced at each run): the server's namespace dir\n"
_LIMIT = 64 << 10  # bytes read at most: init's file is a few lines of paths
_KINDS = {
    stat.S_IFDIR: "directory",
    stat.S_IFLNK: "symlink",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFIFO: "FIFO",
    stat.S_IFSOCK: "socket",
}


def contents(lines: str) -> bytes:
    """What the env file holds: the header, then `lines` (as --print-env prints them)."""
    return (HEADER + lines).encode()


def check_replaceable(path: Path) -> None:
    """ConfigError unless nothing is at `path` or it is a file init wrote (see the module
    doc); nothing is changed either way."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise ConfigError(f"--env-file {path}: {e.strerror or e}") from e
    if not stat.S_ISREG(st.st_mode):
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "file of another type")
        raise ConfigError(
            f"--env-file {path} is a {kind}, not a file cachemgr init wrote; not replaced: "
            "pass another path"
        )
    if not is_ours(_read(path)):
        raise ConfigError(
            f"--env-file {path} is a file cachemgr init did not write (its first line is not "
            f"`{MARK}…`); not replaced: pass another path, or remove it if it is yours to"
        )


def check_outside(path: Path, layout: Layout) -> None:
    """ConfigError if `path` is in a dir of cachemgr's own under the root (ns/, .trash/, the
    state dir): init writes there itself, after this check, and the env file then replaced
    the binding file or manifest it had just written (exit 0, the namespace left alone as
    bad-manifest ever after)."""
    where = Path(os.path.realpath(path.parent))
    for own in (layout.ns_root, layout.trash, layout.state_dir):
        if where.is_relative_to(os.path.realpath(own)):
            raise ConfigError(
                f"--env-file {path} is in {own}, cachemgr's own dir (manifests, bindings, "
                "pages, its state); pass a path of init's own, e.g. /run/sglang/hicache.env"
            )


def _read(path: Path) -> str | None:
    """The file's text, None if it cannot be one of init's: too large, not UTF-8, or not a
    regular file any more (replaced since the lstat: no link followed, no FIFO waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return ""  # gone since the lstat: nothing to lose
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, _LIMIT + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return raw.decode() if len(raw) <= _LIMIT else None
    except UnicodeDecodeError:
        return None


def is_ours(text: str | None) -> bool:
    """Whether `text` is an env file init wrote, with its header or before it had one."""
    if text is None:
        return False
    return text == "" or text.startswith(MARK) or _headerless(text)


def _headerless(text: str) -> bool:
    """Whether `text` is exactly what init wrote before the header: `NAME=value` lines."""
    if not text.endswith("\n"):
        return False
    names = {name for engine in engines.ENGINES for name in engine.server_env_vars}
    for line in text[:-1].split("\n"):
        name, sep, quoted = line.partition("=")
        if not sep or name not in names:
            return False
        try:
            words = shlex.split(quoted)
        except ValueError:
            return False
        if len(words) != 1 or shlex.quote(words[0]) != quoted:
            return False
    return True
