"""What a deleting run carries down its steps (GC's steps, a purge's and GC's trash drains):
where, as whom, how fast, and when to stop."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cachemgr.fs.deletion import Pacer
from cachemgr.layout import Layout
from cachemgr.ns.liveuse import live_users
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
    stop: Callable[[], bool] = lambda: False  # true (a shutdown): end after the current part
    # False: this process may delete no more (fleet mode: it lost the GC lease); asked with
    # `stop` before each step, chunk and part of a real run.
    fence: Callable[[], bool] = lambda: True
    # Who uses a namespace dir right now: none may lose it as unbound.
    users: DirUsers = live_users
    # Told who holds the state DB's write lock when a chunk could not take it within a write's
    # wait (the run deletes no more), or when the record of a chunk already deleted has waited
    # that long (it waits on: the files are gone); whoever waits for the run may answer
    # meanwhile (POST /v1/gc).
    locked: Callable[[str], None] = unheeded
