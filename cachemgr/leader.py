"""Leadership of one root: whoever holds an exclusive flock on a lock file in the state dir
leads (gc.lock: GC deletes; index.lock: the daemon indexes).

flock belongs to the open file description, so the kernel releases it when the holder exits
or dies, and a second descriptor, even in the same process, cannot take it meanwhile.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from pathlib import Path

GC_LOCK = "gc.lock"  # in the state dir: whoever holds it deletes for GC


class Leadership:
    """Non-blocking leader election over one lock file; the leader keeps it until release."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> bool:
        """Become the leader if nobody is; True if this process leads now."""
        if self._fd is not None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        note = f"pid {os.getpid()} on {socket.gethostname()} since {stamp}\n"
        self._fd = fd
        # Informational, and it needs a block: on a full disk leading matters more (GC frees it).
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, note.encode(), 0)
        return True

    def holder(self) -> str | None:
        """Who leads, as the leader wrote it (informational; may be a dead leader's line)."""
        try:
            return self.path.read_text(encoding="utf-8").strip() or None
        except FileNotFoundError:
            return None

    def release(self) -> None:
        """Give up leadership (process exit does the same)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
