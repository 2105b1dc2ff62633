"""A foreign holder of the state DB's write lock: the `sqlite3` shell in another process, as a
person's is (a connection of the test's own process is this process's to cachemgr, whose own
writers GC waits out); and the CLI run in this process, for a test that makes the lock come
at one point of its run."""

from __future__ import annotations

import logging
import sqlite3
import subprocess
import threading
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

from cachemgr.cli.main import main


def hold_write_lock(db: Path) -> subprocess.Popen[str]:
    """The sqlite3 shell in another process, inside BEGIN IMMEDIATE once this returns."""
    shell = subprocess.Popen(
        ["sqlite3", "-batch", str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert shell.stdin is not None and shell.stdout is not None
    shell.stdin.write("BEGIN IMMEDIATE;\nSELECT 'held';\n")
    shell.stdin.flush()
    assert shell.stdout.readline() == "held\n"
    return shell


def release(shell: subprocess.Popen[str]) -> None:
    assert shell.stdin is not None and shell.stdout is not None
    shell.stdin.write("ROLLBACK;\n")
    shell.stdin.close()
    assert shell.wait(10) == 0
    shell.stdout.close()


class ForeignLock:
    """Takes `db`'s write lock when asked, lets go when asked or at the end of a `with`."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.shell: subprocess.Popen[str] | None = None
        self.taken = 0  # times taken so far
        self.named: list[str] = []  # the holders a run was told of (`told`)

    def take(self) -> None:
        self.shell = hold_write_lock(self.db)
        self.taken += 1

    def take_once(self, *_: object) -> None:
        """Take the lock the first time this is called (in a progress callback's place)."""
        if not self.taken:
            self.take()

    def told(self, holder: str) -> None:
        """In `RunContext.locked`'s place: note whom the run named, and let go."""
        self.named.append(holder)
        self.release()

    def release(self) -> None:
        if self.shell is not None:
            release(self.shell)
            self.shell = None

    def __enter__(self) -> ForeignLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextmanager
def held_here(db: Path, seconds: float) -> Iterator[None]:
    """`db`'s write lock held by another connection of this process (as the daemon's index
    thread holds it for a long reconcile), let go `seconds` after the block starts."""
    ours = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    with closing(ours):
        ours.execute("BEGIN IMMEDIATE")
        letgo = threading.Timer(seconds, ours.rollback)
        letgo.start()
        try:
            yield
        finally:
            letgo.join()


def cli_here(argv: list[str]) -> int:
    """`cachemgr <argv>` in this process (where a test's hooks reach it): its exit code. The
    CLI points the `cachemgr` logger at its own handler, unpropagated; that is undone, or
    pytest's log capture in the tests after it in this process sees nothing."""
    logger = logging.getLogger("cachemgr")
    kept = logger.handlers[:], logger.level, logger.propagate
    try:
        main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    finally:
        logger.handlers[:], logger.level, logger.propagate = kept
    return 0
