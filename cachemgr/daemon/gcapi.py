"""The JSON shape of a GC run, for `POST /v1/gc` and `cachemgr gc --json`; GC runs for HTTP
requests, one at a time, shared by the requests that arrive while one runs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import anyio.to_thread
from anyio import CapacityLimiter
from pydantic import BaseModel, Field

from cachemgr.daemon.api import GcLimits, GcUnmet
from cachemgr.errors import StateLocked
from cachemgr.gc.policy import GcPolicy, GcReason
from cachemgr.gc.runner import GcRunner
from cachemgr.gc.step import GcReport, StepResult
from cachemgr.ns.runcontext import unheeded
from cachemgr.state.dbfile import denied_as_unavailable

# Seconds between a waiting request's looks at whether its run waits out a foreign DB lock.
LOCK_POLL = 0.1


class GcStepOut(BaseModel):
    """One step of a GC run: one reason, one directory."""

    reason: GcReason
    dir: str = Field(description="directory below the root")
    namespace_id: str | None
    planned_files: int
    planned_bytes: int
    files: int = Field(description="deleted (or, in a dry run, that would be)")
    bytes: int
    vanished: int = Field(description="already gone when GC got to them")
    young: int = Field(description="kept: modified within the age limit")
    refused: list[str] = Field(
        description="kept: not a page or temp regular file, or the kernel refused the unlink"
    )
    skipped: str | None = None
    overridden: int = Field(
        0,
        description="pages requests reached while the run deleted that its limit took after all "
        "(cachemgr_gc_protection_overridden_total counts them)",
    )

    @classmethod
    def of(cls, s: StepResult) -> GcStepOut:
        """The JSON shape of one step's result."""
        return cls(
            reason=s.reason,
            dir=s.rel_dir,
            namespace_id=s.namespace_id,
            planned_files=s.planned_files,
            planned_bytes=s.planned_bytes,
            files=s.files,
            bytes=s.bytes,
            vanished=s.vanished,
            young=s.young,
            refused=list(s.refused),
            skipped=s.skipped,
            overridden=s.overridden,
        )


class GcTotal(BaseModel):
    files: int
    bytes: int


class GcResponse(BaseModel):
    """The outcome of a GC run."""

    leader: bool = Field(description="false: another process leads GC on this root")
    holder: str | None = Field(None, description="the GC leader, when it is not this process")
    dry_run: bool
    started_at: float
    seconds: float
    files: int
    bytes: int
    by_reason: dict[GcReason, GcTotal]
    steps: list[GcStepOut]
    warnings: list[str]
    held: bool = Field(
        description="false: a cap or a floor needed files gone that could not be deleted (see "
        "warnings and each step's refused), or GC had too little it may delete (see unmet)"
    )
    unmet: list[GcUnmet] = Field(
        default_factory=list,
        description="limits the run left over their high watermark with nothing else it may delete",
    )

    @classmethod
    def of(cls, report: GcReport) -> GcResponse:
        """The response for a report."""
        return cls(
            leader=report.leader,
            holder=report.holder,
            dry_run=report.dry_run,
            started_at=report.started_at,
            seconds=round(report.finished_at - report.started_at, 6),
            files=report.files,
            bytes=report.bytes,
            by_reason={r: GcTotal(files=f, bytes=b) for r, (f, b) in report.totals().items()},
            steps=[GcStepOut.of(s) for s in report.steps],
            warnings=list(report.warnings),
            held=report.held,
            unmet=[GcUnmet.of(u) for u in report.unmet],
        )


def gc_request(
    runner: GcRunner,
    *,
    dry_run: bool = False,
    actor: str = "http",
    policy: GcPolicy | None = None,
    locked: Callable[[str], None] = unheeded,
) -> GcResponse:
    """What `POST /v1/gc` does: one full run (with a sweep) by the daemon's runner, under
    `policy` (one-off limits) or the runner's own; `locked` as GcRunner.run's."""
    with denied_as_unavailable(runner.layout.state_dir):
        report = runner.run(dry_run=dry_run, actor=actor, sweep=True, policy=policy, locked=locked)
    return GcResponse.of(report)


def gc_limits(policy: GcPolicy) -> GcLimits:
    """The limits a policy keeps, as /v1/status shows them."""
    return GcLimits(
        max_bytes=policy.max_bytes,
        namespace_max_bytes=policy.namespace_max_bytes,
        min_free_bytes=policy.min_free_bytes,
        max_files=policy.max_files,
        namespace_max_files=policy.namespace_max_files,
        min_free_percent=policy.min_free_percent,
        min_free_inodes_percent=policy.min_free_inodes_percent,
        min_age_seconds=policy.min_age,
        tmp_ttl_seconds=policy.tmp_ttl,
        delete_rate=policy.delete_rate,
    )


class SharedGcRuns:
    """`POST /v1/gc`'s runs: one real and one dry run at most at a time for each set of
    limits, in a thread each; a request arriving during a run of its kind (dry or not, the
    same limits) gets that run's result.

    Joining is an await, not a worker thread: sync routes run on anyio's pool of 40 threads,
    which /healthz and /metrics share, and 50 requests queued on a 10 s GC used to take it all.

    A run that finds another process holding the state DB's write lock deletes no more, and
    its requests get StateLocked (503); one whose record of deleted files waits that lock out
    (it must: the files are gone) answers so then, not once the lock is gone.
    """

    def __init__(self, runner: GcRunner) -> None:
        self.runner = runner
        self._running: dict[tuple[bool, GcPolicy | None], _Run] = {}
        self._threads = CapacityLimiter(2)  # apart from the pool's tokens, which routes need

    async def run(self, *, dry_run: bool, policy: GcPolicy | None = None) -> GcResponse:
        """The result of the run of this kind in progress, or of a new one."""
        kind = (dry_run, policy)
        run = self._running.get(kind)
        if run is None:
            holders: list[str] = []
            work = partial(
                gc_request, self.runner, dry_run=dry_run, policy=policy, locked=holders.append
            )
            future = asyncio.ensure_future(anyio.to_thread.run_sync(work, limiter=self._threads))
            run = self._running[kind] = _Run(future, holders)
            future.add_done_callback(partial(self._ended, kind))
        # asyncio.wait, not the future: a client that disconnects cancels its wait, not the
        # run the others share, nor the record of a run it no longer waits for.
        while not (await asyncio.wait({run.future}, timeout=LOCK_POLL))[0]:
            if run.holders:
                raise StateLocked(
                    f"GC stopped: the state DB is write-locked by {run.holders[0]}; it deletes "
                    "no more this run, and records what it deleted (index and audit) once the "
                    "lock is released: ask again then"
                )
        return run.future.result()

    def _ended(
        self, kind: tuple[bool, GcPolicy | None], future: asyncio.Future[GcResponse]
    ) -> None:
        self._running.pop(kind, None)
        if not future.cancelled():
            future.exception()  # (seen: a run its requests stopped waiting for may fail later)


@dataclass(frozen=True)
class _Run:
    """A run in progress: its result to come, and who held the DB's lock if it waited."""

    future: asyncio.Future[GcResponse]
    holders: list[str]
