"""Leadership of one root: whoever holds an exclusive flock on a lock file in the state dir
leads (gc.lock: GC deletes; index-<boot id>.lock: the daemon indexes). The lock file is opened
without following links: a symlink planted there is refused, never truncated through.

flock belongs to the open file description, so the kernel releases it when the holder exits
or dies, and a second descriptor, even in the same process, cannot take it meanwhile.

GC's leader also flocks the root dir itself (`gc_leadership`): the state dir is a setting, and
two daemons on one root with different state dirs each held their own gc.lock and both deleted
(each taking what its own plan found over the cap: the root fell below the low watermark).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from cachemgr.errors import UnsafePathError
from cachemgr.fs.safe import open_dir, open_file, read_regular
from cachemgr.layout import Layout


class Leadership:
    """Non-blocking leader election over one lock file (and `root`'s own flock, if given);
    the leader keeps it until release."""

    def __init__(self, path: Path, root: Path | None = None) -> None:
        self.path = path
        self.root = root
        self._fd: int | None = None
        self._root_fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> bool:
        """Become the leader if nobody is; True if this process leads now."""
        if self._fd is not None:
            return True
        fd = open_file(self.path, os.O_RDWR | os.O_CREAT)  # a planted link: UnsafePathError
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        if not self._take_root():
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            return False
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        note = f"pid {os.getpid()} uid {os.geteuid()} on {socket.gethostname()} since {stamp}\n"
        self._fd = fd
        # Informational, and it needs a block: on a full disk leading matters more (GC frees it).
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, note.encode(), 0)
        return True

    def _take_root(self) -> bool:
        """The root dir's exclusive flock, kept with the lock file's; False while another
        process holds it. Where a dir cannot be flock'd (NFS emulates flock with byte-range
        locks, which a dir opened read-only cannot take) the lock file alone decides, as it
        did before; a root that cannot be opened is GC's own error to report."""
        if self.root is None:
            return True
        fd = self._open_root()
        if fd is None:
            return True
        taken = _try_flock(fd, fcntl.LOCK_EX)
        if taken:
            self._root_fd = fd
        else:
            os.close(fd)
        return taken is not False

    def _open_root(self) -> int | None:
        assert self.root is not None
        try:
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None

    def _root_led_elsewhere(self) -> bool:
        """Whether another process holds the root's flock (a GC leader with another state
        dir, when this process's lock file is free)."""
        if self.root is None or self._root_fd is not None:
            return False
        fd = self._open_root()
        if fd is None:
            return False
        try:
            return _try_flock(fd, fcntl.LOCK_SH) is False  # (closing drops a shared lock)
        finally:
            os.close(fd)

    def fence(self) -> bool:
        """Whether this process may delete now (asked before each chunk): a flock is the
        kernel's, held until released. Fleet mode asks its coordinator (cachemgr.fleet)."""
        return self.held

    def run_fence(self) -> Callable[[], bool]:
        """The fence for one run, taken as it starts: a flock is held until released, so it is
        `fence`. Fleet mode pins the lease's term the run began under (cachemgr.fleet)."""
        return self.fence

    def led_elsewhere(self) -> bool:
        """Whether another process leads now, asked without leading: a shared lock, taken and
        dropped at once, fails only while someone holds the exclusive one. Creates nothing."""
        return self._file_led_elsewhere() or self._root_led_elsewhere()

    def _file_led_elsewhere(self) -> bool:
        try:
            fd = open_file(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False  # never led: nobody made the lock file
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops the shared lock if it was taken
        return False

    def holder(self) -> str | None:
        """Who leads, as the leader wrote it (informational; may be a dead leader's line)."""
        if not self._file_led_elsewhere() and self._root_led_elsewhere():
            return f"a process with another state dir than {self.path.parent}"
        try:
            with open_dir(self.path.parent, "") as dir_fd:
                raw = read_regular(dir_fd, self.path.name, 4096)
        except (FileNotFoundError, UnsafePathError):
            return None
        return raw.decode("utf-8", "replace").strip() or None

    def release(self) -> None:
        """Give up leadership (process exit does the same)."""
        for fd in (self._root_fd, self._fd):
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        self._fd = self._root_fd = None


def _try_flock(fd: int, op: int) -> bool | None:
    """flock without waiting: True if taken, False while another holds it, None where the
    filesystem cannot flock this descriptor."""
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def gc_leadership(layout: Layout) -> Leadership:
    """GC's leadership of the root: its state dir's gc.lock and the root's own flock."""
    return Leadership(layout.gc_lock, root=layout.root)


def kernel_id() -> str:
    """The running kernel's boot id: one indexer per kernel (cachemgr.daemon.index_leader)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    except OSError:
        return socket.gethostname()


def index_files(layout: Layout) -> tuple[Leadership, Path]:
    """This kernel's index lock on the root, and the marker its leader keeps while ready."""
    boot = kernel_id()
    return Leadership(layout.index_lock(boot)), layout.index_ready(boot)


def index_live(layout: Layout) -> bool:
    """Whether a daemon (this process, or another) indexes the root on this kernel now, its
    index built: its lock held and its ready marker there (one killed leaves the marker, not
    the lock). Its per-namespace counts (`namespace_stats`) are then the disk's, a batch
    behind: what a purge or an init may report instead of counting millions of files."""
    leadership, ready = index_files(layout)
    try:
        return leadership.led_elsewhere() and os.path.lexists(ready)
    except (OSError, UnsafePathError):
        return False
