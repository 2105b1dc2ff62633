"""The root lock: one writer of namespaces and bindings at a time, across processes and threads.

An flock on <state_dir>/root.lock excludes other processes (init, purge, the daemon); a
per-path re-entrant thread lock excludes other threads of this process, and lets a function
that holds the lock call another that takes it too (flock is per open file, so taking it twice
from one process would deadlock).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from cachemgr.errors import ConfigError, ConflictError
from cachemgr.fs.safe import open_file
from cachemgr.layout import Layout


@dataclass
class _Held:
    rlock: threading.RLock = field(default_factory=threading.RLock)
    depth: int = 0
    fd: int | None = None


_held: dict[Path, _Held] = {}
_guard = threading.Lock()


@contextmanager
def root_lock(
    layout: Layout,
    *,
    timeout: float = 30.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[None]:
    """Hold the root's lock; ConflictError naming the holder if it is not free in `timeout` s."""
    path = layout.root_lock
    with _guard:
        held = _held.setdefault(path, _Held())
    if not held.rlock.acquire(timeout=timeout):
        raise ConflictError(f"another thread of this process holds {path} (waited {timeout:g} s)")
    try:
        if held.depth == 0:
            held.fd = _flock(path, timeout, clock, sleep)
        held.depth += 1
        try:
            yield
        finally:
            held.depth -= 1
            if held.depth == 0 and held.fd is not None:
                os.close(held.fd)  # closing releases the flock
                held.fd = None
    finally:
        held.rlock.release()


def _flock(
    path: Path, timeout: float, clock: Callable[[], float], sleep: Callable[[float], None]
) -> int:
    """Open and exclusively flock `path`, writing our pid into it for whoever waits next."""
    try:
        fd = open_file(path, os.O_RDWR | os.O_CREAT)  # a planted link: UnsafePathError
    except OSError as e:
        raise ConfigError(f"cannot open lock {path}: {e.strerror or e}") from e
    deadline = clock() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or clock() >= deadline:
                holder = _holder(fd)
                os.close(fd)
                raise ConflictError(
                    f"{path} is held by {holder} (waited {timeout:g} s); "
                    "another init or purge is running on this root"
                ) from e
            sleep(0.05)
    # For whoever waits next; it needs a block, which a full disk may not have: then unsaid.
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _holder(fd: int) -> str:
    """Who holds the lock: the kernel's word (/proc/locks) first, else the pid written in it.

    The written pid is the last cachemgr holder's, often this very process (the daemon took
    the lock for an earlier purge): a process that flocks the file without writing (a
    person's `flock`, a backup tool) would go unnamed, and the message would name us."""
    pids = flock_holders(fd)
    if pids:
        return ", ".join(describe_pid(pid) for pid in pids)
    written = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    if written.isdigit() and int(written) != os.getpid():
        return describe_pid(int(written))
    return "another process"


class ProcLock(NamedTuple):
    """One held lock as /proc/locks lists it (in the reader's pid namespace)."""

    kind: str  # FLOCK, POSIX, OFDLCK
    access: str  # READ, WRITE
    pid: int
    file: tuple[int, int, int]  # (major, minor, inode)
    start: int
    end: int  # inclusive; EOF: the largest


def proc_locks(locks: Path = Path("/proc/locks")) -> list[ProcLock]:
    """The held locks of the machine; [] if /proc/locks cannot be read. Waiters ("->") are
    left out."""
    try:
        text = locks.read_text(encoding="ascii", errors="replace")
    except OSError:
        return []
    found = []
    # "1: FLOCK  ADVISORY  WRITE 4242 08:01:131074 0 EOF"; a waiter's line has "->" second.
    for fields in (line.split() for line in text.splitlines()):
        if len(fields) < 8 or fields[1] == "->":
            continue
        try:
            major, minor, inode = fields[5].split(":")
            end = 1 << 63 if fields[7] == "EOF" else int(fields[7])
            found.append(
                ProcLock(
                    fields[1],
                    fields[3],
                    int(fields[4]),
                    (int(major, 16), int(minor, 16), int(inode)),
                    int(fields[6]),
                    end,
                )
            )
        except ValueError:
            continue
    return found


def file_key(st: os.stat_result) -> tuple[int, int, int]:
    """A file as /proc/locks names it."""
    return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino


def flock_holders(fd: int, locks: Path = Path("/proc/locks")) -> list[int]:
    """The pids that hold an flock on the file open at `fd`, as /proc/locks lists them (the
    kernel reports them in the reader's pid namespace); [] if it cannot be read."""
    here = file_key(os.fstat(fd))
    pids = []
    for lock in proc_locks(locks):
        if lock.kind == "FLOCK" and lock.file == here and lock.pid not in pids:
            pids.append(lock.pid)
    return pids


def describe_pid(pid: int) -> str:
    """`pid 4242 (flock)`: the pid with its command name, if it can be read."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return f"pid {pid}"
    return f"pid {pid} ({comm})"
