"""What a deleting run carries down its steps (GC's steps, a purge's and GC's trash drains):
where, as whom, how fast, and when to stop."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cachemgr.errors import StateLocked
from cachemgr.fs.deletion import Pacer
from cachemgr.layout import Layout
from cachemgr.ns.liveuse import live_users
from cachemgr.state import busy
from cachemgr.state.store import Store

DirUsers = Callable[[Path], list[int]]  # the pids using a dir as their storage dir (liveuse.py)


def unheeded(_holder: str) -> None:
    """`RunContext.locked` of a run nobody waits on: its record just waits the lock out."""


@dataclass(frozen=True)
class RunContext:
    """One run's context, the same for each of its steps (uvicorn's `Config` for a run)."""

    layout: Layout
    store: Store
    actor: str = "cli"  # who asked, as the audit rows and the log say
    dry_run: bool = False  # stat the same files, delete none
    pacer: Pacer | None = None  # deletions per second at most (None: unpaced)
    clock: Callable[[], float] = time.time
    stop: Callable[[], bool] = lambda: False  # true (a shutdown): end after the current chunk
    # False: this process may delete no more (fleet mode: it lost the GC lease); asked with
    # `stop` before each step and chunk of a real run, and each part of a drain.
    fence: Callable[[], bool] = lambda: True
    # Who uses a namespace dir right now: none may lose it as unbound.
    users: DirUsers = live_users
    # Told who holds the state DB's write lock when a step or chunk could not take it within a
    # write's wait (recordable: the run deletes no more), or when the record of files already
    # deleted has waited that long (record_deleted: it waits on); whoever waits for the run may
    # answer meanwhile (POST /v1/gc).
    locked: Callable[[str], None] = unheeded

    def recordable(self) -> bool:
        """Whether what a step or chunk deletes can be recorded now: the state DB's write lock
        is free, or freed within a write's wait. Under a foreign holder (a person's `sqlite3`
        shell in a transaction, a backup tool) a chunk's files went, and its record waited for
        as long as the holder held on; now the run deletes nothing more (`locked` is told). A
        lock taken after this is waited out by the record (record_deleted).

        This process's own writer is waited out, a write's wait at a time: a reconcile that
        drops millions of rows, or the model's save, ends by itself (as the lock tally's
        logs and /readyz take it), and GC's run failed as locked by "this process"."""
        while True:
            try:
                with self.store.transaction():
                    return True
            except StateLocked:
                if not busy.held_here(self.store.path):
                    self._tell_locked()
                    return False
                if self.stop():  # a shutdown (or the lease lost) ends the wait: nothing to tell
                    return False

    def record_deleted(self, write: Callable[[float | None], None]) -> None:
        """Record files already deleted: `write(patience)` is a transaction that waits that
        many seconds for the write lock (None: a write's wait). The files are gone, so a foreign
        lock held longer is waited out however long it lasts, once `locked` is told who holds
        it; nothing of the first try was written."""
        try:
            write(None)
        except StateLocked:
            if not busy.held_here(self.store.path):  # (this process's own writer ends by itself)
                self._tell_locked()
            write(math.inf)

    def _tell_locked(self) -> None:
        self.locked(busy.describe_holders(self.store.path))
