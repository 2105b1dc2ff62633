"""A held root lock names its real holder: the kernel's /proc/locks, not the pid written in the
file, which is the last cachemgr holder's (often the asking daemon itself)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachemgr.errors import ConflictError
from cachemgr.fs.locks import flock_holders, root_lock
from cachemgr.layout import Layout

HOLD = (
    "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDWR)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"  # as `flock(1)` or a backup tool would: no pid written
    "print('held', flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def foreign_holder(layout: Layout) -> Iterator[subprocess.Popen[str]]:
    """Another process flocking root.lock, after this process held it (and wrote its pid)."""
    with root_lock(layout):
        pass
    assert layout.root_lock.read_text().strip() == str(os.getpid())
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(layout.root_lock)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        yield proc
    finally:
        proc.kill()
        proc.communicate()  # reaps it and closes its pipe


def test_the_conflict_names_the_process_that_holds_the_lock(
    layout: Layout, foreign_holder: subprocess.Popen[str]
) -> None:
    with pytest.raises(ConflictError) as e, root_lock(layout, timeout=0.2):
        pass
    message = str(e.value)
    assert f"held by pid {foreign_holder.pid} (python" in message, message
    assert f"pid {os.getpid()}" not in message, message


def test_proc_locks_lines_are_matched_by_device_and_inode(tmp_path: Path) -> None:
    target = tmp_path / "lock"
    target.write_text("")
    st = target.stat()
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    locks = tmp_path / "locks"
    locks.write_text(
        f"1: FLOCK  ADVISORY  WRITE 4242 {dev}:{st.st_ino} 0 EOF\n"
        f"1: -> FLOCK  ADVISORY  WRITE 777 {dev}:{st.st_ino} 0 EOF\n"  # a waiter, not a holder
        f"2: POSIX  ADVISORY  WRITE 99 {dev}:{st.st_ino} 0 EOF\n"  # fcntl locks: not the flock
        f"3: FLOCK  ADVISORY  WRITE 31 {dev}:{st.st_ino + 1} 0 EOF\n"  # another file
        "4: garbage\n"
    )
    fd = os.open(target, os.O_RDONLY)
    try:
        assert flock_holders(fd, locks) == [4242]
        assert flock_holders(fd, tmp_path / "absent") == []
    finally:
        os.close(fd)
