"""Other users for the deploy tests: a forked child of the test process that drops to a
throwaway uid, its groups and a umask, as systemd's User=, SupplementaryGroups= and UMask= (or
a container's runAsUser and fsGroup) make a process.

The interpreters live under /root (mode 0700 here), which another uid cannot enter: the user
keeps one capability, CAP_DAC_READ_SEARCH (read any file, enter any dir; never write, create or
delete), also across exec (an ambient capability), so Python can import what it needs. Every
write, create and unlink is still checked against the user's uid, groups and the dir modes, and
access(2) ignores capabilities. The tests run as root (they skip otherwise): nothing is added
to /etc/passwd, the ids are numbers.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from cachemgr.cli.main import main
from tests.daemon_helpers import settled
from tests.nsfixtures import cli
from tests.polling import wait_for

T = TypeVar("T")
PR_SET_KEEPCAPS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE = 8, 47, 2
CAP_DAC_READ_SEARCH = 2
READ_SEARCH = 1 << CAP_DAC_READ_SEARCH
CAPABILITY_V3 = 0x20080522  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words per set
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")


@dataclass(frozen=True)
class User:
    """A process's credentials: its uid, its groups (the primary first), its umask."""

    uid: int
    gids: tuple[int, ...]
    umask: int = 0o002

    def become(self) -> None:
        """Drop this (root) process to the user, for good (a Popen preexec_fn, or a fork); for
        uid 0 (an engine container's root) only the umask changes."""
        os.umask(self.umask)
        if self.uid == 0:
            return
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0)
        os.setgroups(list(self.gids))
        os.setgid(self.gids[0])
        os.setuid(self.uid)
        header = (ctypes.c_uint32 * 2)(CAPABILITY_V3, 0)
        data = (ctypes.c_uint32 * 6)(READ_SEARCH, READ_SEARCH, READ_SEARCH, 0, 0, 0)
        if libc.capset(header, data) == 0:  # without it, only a reachable interpreter works
            libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_DAC_READ_SEARCH, 0, 0)


def as_user(user: User, fn: Callable[[], T]) -> T:
    """fn() run in a forked child as `user`; its result (or its exception) comes back."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read_fd)
        try:
            user.become()
            result: Any = ("ok", fn())
        except BaseException:  # the test sees the child's own traceback
            result = ("error", traceback.format_exc())
        with os.fdopen(write_fd, "wb") as pipe:
            pickle.dump(result, pipe)
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        raw = pipe.read()
    os.waitpid(pid, 0)
    kind, value = pickle.loads(raw)
    if kind == "error":
        raise AssertionError(f"as uid {user.uid}:\n{value}")
    return value  # type: ignore[no-any-return]


def cli_as(
    user: User, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`cachemgr ARGS` (tests.nsfixtures.cli) as `user`."""
    return as_user(user, lambda: cli(*args, env=env))


@contextmanager
def process_as(user: User, fn: Callable[[], object]) -> Iterator[int]:
    """fn() running in a forked child as `user` (a daemon) until the block ends: SIGTERM, then
    the child is reaped. Yields its pid."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            user.become()
            fn()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stderr.flush()
        os._exit(code)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)


@contextmanager
def shared_dir(prefix: str) -> Iterator[Path]:
    """A temp dir other users can reach (pytest's tmp_path is 0700 root), removed after."""
    top = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        os.chmod(top, 0o755)
        yield top
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(top)], check=False)


def shared_root(parent: Path, owner: int, group: int, mode: int = 0o2775) -> Path:
    """The deploy's cache root: `install -d -o OWNER -g GROUP -m 2775`."""
    root = parent / "hicache"
    root.mkdir()
    os.chown(root, owner, group)
    os.chmod(root, mode)
    return root


@contextmanager
def daemon_as(user: User, root: Path, port: int, env: dict[str, str]) -> Iterator[str]:
    """`cachemgr serve` on `root` as `user` (its settings from `env`, as a unit's
    Environment= gives them), ready; yields its URL."""

    def serve() -> None:
        os.environ.update(env)
        main(["--log-format", "json", "--root", str(root), "serve", "--port", str(port)])

    url = f"http://127.0.0.1:{port}"
    with process_as(user, serve):
        wait_for(lambda: _ready(url), timeout=60, what=f"the daemon as uid {user.uid}")
        yield url


def _ready(url: str) -> bool:
    try:
        return settled(httpx.get(f"{url}/readyz", timeout=2))
    except httpx.HTTPError:
        return False
