"""Carry out a GC plan: delete through cachemgr.fs.deletion, keep the index, audit each step."""

from __future__ import annotations

import errno
import logging
import math
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

from cachemgr.backends import FileFormat
from cachemgr.errors import UnsafePathError
from cachemgr.fs.deletecheck import Refusal, dir_at, files_of, reason_of
from cachemgr.fs.deletion import (
    DeleteReport,
    Listeners,
    Pacer,
    Progress,
    delete_files,
    delete_own_temps,
)
from cachemgr.gc.behind import Behind
from cachemgr.gc.drop import drop_namespace, why_stays
from cachemgr.gc.find import step_format
from cachemgr.gc.pagestore import PageId
from cachemgr.gc.plan import GcPlan
from cachemgr.gc.policy import FILE_LIMITS, HOLDING
from cachemgr.gc.step import GcReport, GcStep, StepResult, linked_verdict
from cachemgr.ns.quarantine import is_denied
from cachemgr.ns.runcontext import RunContext
from cachemgr.ns.trash import drain_entry
from cachemgr.state import pages_sql

log = logging.getLogger(__name__)
# Names per delete call: each chunk's index rows and its audit row are written in one
# transaction once its files are gone, so a kill -9 leaves at most one chunk unaudited; a stop
# (a shutdown, the GC lease lost) is asked before each, as is the fence: a chunk is one part
# (cachemgr.fs.deletion.PART). Chunks of 1,024 evicted ~7 % faster, but the requests' pages
# are spared a chunk at a time (Spare): on recorded traffic the cache fell further under a cap
# (bench/RESULTS.md, session 32).
CHUNK = 256
# (namespace, the step's names, from which on they are not deleted yet) -> names to spare after
# all (asked before each chunk of a step that holds a limit: a request may have reached a page
# since the plan).
Spare = Callable[[str, Sequence[str], int], Collection[str]]


class InFlight(NamedTuple):
    """The pages requests use now that the live daemon's chain model has not seen, at a plan."""

    queued: Collection[PageId] = ()  # pages read or stored, not applied to the model yet
    spare: Spare | None = None  # asked before each chunk (None: nothing comes in between)
    # Page files stored that the index has not applied, as (namespace, name), in the order a
    # cap takes them, the last thing it takes (cachemgr.daemon.backlog.take_order).
    stored: Sequence[tuple[str, str]] = ()
    stored_bytes: int = 0  # the size each of them is counted at (0: not known yet)


class Unlinking(Protocol):
    """Told of each chunk of a namespace's pages a run holding a limit is about to unlink, then
    of those it did unlink (the daemon's watcher drops the deletions it was told of:
    cachemgr.daemon.owndeletes)."""

    def expect(self, ns: str, names: Sequence[str]) -> None: ...

    def settle(self, ns: str, names: Sequence[str], deleted: Collection[str]) -> None: ...

    def again(self, ns: str, names: Sequence[str]) -> Collection[str]:
        """Of `names` (unlinked, about to be recorded gone), those stored again since."""
        ...


# (namespace, names a chunk of a step holding a limit recorded as gone, deleted or gone before
# it got to them): the daemon's model forgets them with their rows (their IN_DELETE never
# reaches the index: Unlinking), and the stores among them the index had not applied are
# pending no more. Not at the run's end: a page stored again meanwhile, which the index
# applied, is on disk; and an error may end the run first.
Recorded = Callable[[str, list[str]], None]


@dataclass
class _Tally:
    """Running totals across steps, for one progress callback over the whole run."""

    progress: Progress | None
    files: int = 0
    bytes: int = 0

    def offset(self) -> Progress | None:
        base_f, base_b, report = self.files, self.bytes, self.progress
        if report is None:
            return None
        return lambda f, b: report(base_f + f, base_b + b)

    def add(self, r: DeleteReport | StepResult) -> None:
        self.files += r.files
        self.bytes += r.bytes


def execute_gc(
    plan: GcPlan,
    run: RunContext,
    *,
    progress: Progress | None = None,
    spare: Spare | None = None,
    unlinking: Unlinking | None = None,
    recorded: Recorded | None = None,
    after_limits: Behind | None = None,
) -> GcReport:
    """Run the plan's steps in order; a dry run stats the same files and deletes none.

    `after_limits` (a run with no pace given): how the steps behind those that hold a limit go
    (trash, temps, dropped namespaces: paced mass work), told `done` before them. A drain of a
    large purge went first, at the run's pace, and held every cap and the floor back for as
    long as it took (3,000 trash files at 100 a second: a 200-page cap reached 1,981).

    `run.stop()` true (a shutdown) ends the run after the chunk being deleted. `run.fence()`
    false (fleet mode: the GC lease is lost) ends it there too, with a warning. `run.users`
    names the running processes whose storage dir a namespace is (none may lose it as
    unbound). `spare`: before each chunk that holds a limit, the names to spare after all;
    `unlinking`: told of each such chunk's unlinks; `recorded`: of the names each such chunk
    recorded as gone, as it does (the run may yet end in an error).
    """
    fenced = [False]
    waited: list[str] = []  # who held the state DB's write lock while a record waited

    def halted() -> bool:
        if not run.dry_run and not fenced[0] and not run.fence():
            fenced[0] = True
        return fenced[0] or bool(waited) or run.stop()

    def locked(holder: str) -> None:
        waited.append(holder)
        run.locked(holder)

    steps_run = replace(run, stop=halted, locked=locked)
    started = run.clock()
    tally = _Tally(progress)
    results = []
    behind = after_limits
    for step in plan.steps:  # those that hold a limit first (plan_gc)
        if behind is not None and step.reason not in HOLDING:
            behind.done()
            steps_run = replace(steps_run, pacer=behind.pacer, stop=_either(halted, behind.stop))
            behind = None
        if steps_run.stop():
            break
        holds = step.reason in HOLDING and step.namespace_id is not None
        told = _Told(None if step.forced else spare, unlinking, recorded) if holds else _Told()
        # A drop audits all its files as it renames them away: it must not give way midway,
        # or the rest, drained later as trash, is audited twice.
        try:
            result = _run_step(
                replace(steps_run, stop=halted) if _drops(step) else steps_run, step, tally, told
            )
        except UnsafePathError as e:  # its dir became a symlink or a mount: the other steps
            log.warning("gc step refused", extra={"dir": step.rel_dir, "error": str(e)})
            # still run; its files are refused, so the report warns and a cap is not held
            whole = Refusal(str(e), "unsafe", max(1, step.files))
            result = StepResult(step, refused=(whole,), skipped=f"refused: {e}")
        except OSError as e:  # another user's dir: the other steps still run (the caller
            if not is_denied(e):  # says so once: cachemgr.ns.quarantine)
                raise
            log.debug("gc step denied", extra={"dir": step.rel_dir, "error": str(e)})
            result = StepResult(step, skipped=f"denied: {e.strerror}", denied=str(e))
        results.append(result)
    warnings = plan.warnings + tuple(refusal_warning(r) for r in results if r.refused)
    overridden = sum(r.overridden for r in results)
    if overridden:
        warnings += (
            f"{overridden} pages requests reached, or found modified within min_age, while the "
            "run deleted evicted: a limit wins over their protection",
        )
    if fenced[0]:
        warnings += ("stopped deleting: this node no longer holds the GC lease",)
    if waited:
        warnings += (
            f"stopped deleting: the state DB was write-locked by {waited[0]}; what was deleted "
            "is recorded (if its record had to wait, once the lock was free)",
        )
    unmet, warnings = linked_verdict(results, plan.unmet, warnings)
    report = GcReport(
        run.dry_run,
        True,
        started,
        run.clock(),
        tuple(results),
        warnings,
        unmet=unmet,
        locked_by=waited[0] if waited else None,
    )
    _log_summary(report, run.actor)
    return report


def refusal_warning(result: StepResult) -> str:
    """One line for the files a step had to keep: how many, why, one example and, when the
    kernel refused (another user's dir without the group's write), the fix."""
    by_reason: dict[str, int] = {}
    for refusal in result.refused:
        by_reason[reason_of(refusal)] = by_reason.get(reason_of(refusal), 0) + files_of(refusal)
    counts = ", ".join(f"{n} {reason}" for reason, n in sorted(by_reason.items()))
    line = (
        f"{sum(by_reason.values())} files in {result.rel_dir} cannot be deleted by uid "
        f"{os.geteuid()} ({counts}), e.g. {result.refused[0]}"
    )
    denied = [str(r) for r in result.refused if reason_of(r) == "permission"]
    if any(_EPERM in r for r in denied):
        line += f"; {EPERM_FIX}"
    if any(_EPERM not in r for r in denied):
        line += f"; {PERMISSION_FIX}"
    if any(_MOUNT in r for r in result.refused):
        line += f"; {MOUNT_FIX}"
    return line


# What to do about files the kernel does not let GC delete (see `cachemgr doctor`): EACCES is a
# dir GC's user may not write in; EPERM is refused whoever writes there (root included).
PERMISSION_FIX = (
    "the writer makes dirs the daemon's group cannot write (its umask is 022?): run the engine "
    "with umask 0002 in the daemon's group (docs/deploy.md), then `chmod -R g+w` its dirs"
)
_MOUNT = "on another mount than"  # (fs.safe's word for a mount point on the way)
MOUNT_FIX = "GC never deletes across a mount: unmount it, or mount it outside the root"
_EPERM = os.strerror(errno.EPERM)
EPERM_FIX = (
    "the file or its dir is immutable or append-only (`lsattr -d`; `chattr -i -a`), or a "
    "sticky dir (mode +t) of another owner (`chmod -t` it)"
)


def _drops(step: GcStep) -> bool:
    """Whether the step drops a whole unbound namespace (cachemgr.gc.drop)."""
    return step.reason in ("unbound", "ttl") and step.remove_dir


def _either(first: Callable[[], bool], second: Callable[[], bool]) -> Callable[[], bool]:
    return lambda: first() or second()


class _Told(NamedTuple):
    """Whom a step asks before each chunk (names to spare), tells of its unlinks and of what
    it recorded gone."""

    spare: Spare | None = None
    unlinking: Unlinking | None = None
    recorded: Recorded | None = None


def _run_step(run: RunContext, step: GcStep, tally: _Tally, told: _Told) -> StepResult:
    layout = run.layout
    dry_run = run.dry_run
    base = StepResult(step)
    if not dry_run and not run.recordable():  # (a chunk of pages asks again: _Chunks)
        return replace(base, skipped=_STOPPED)
    if _drops(step) and step.namespace_id and not dry_run:
        result = drop_namespace(run, step, tally.offset())
        tally.add(result)
        return result
    why = step.reason in ("unbound", "ttl") and why_stays(run, step.namespace_id)
    if why:  # a dry run says what the drop would find under the lock
        return replace(base, skipped=why)
    if step.reason == "trash":  # the same path as a purge's own drain, audited there
        entry = step.rel_dir.removeprefix(".trash/")
        r = drain_entry(run, entry, progress=tally.offset())
        tally.add(r)
        return base.done(r)
    if step.namespace_id is None and step.reason == "tmp":
        return _sweep_own_temps(run, step, base)
    fmt = step_format(layout, step)
    chunks = _Chunks(run, step, fmt, tally, told)
    staying: set[str] = set()
    done, ended = chunks.delete(_unspared(step, told.spare, staying))
    back, young = DeleteReport(dry_run=dry_run), 0
    if ended is None:
        # Pages spared since the plan yield to the limit as any protection does: tails first,
        # in the step's order (what stays of a chain is a usable prefix), as far as it needs.
        # So do a limit's pages found modified within min_age at deletion, which the index
        # knew older (a restore's touch, a store while no daemon watched, a writer's clock
        # ahead): min_age never stops a limit, and the next plan would pick them again.
        # Only those go without the age rule: a spared page keeps it as in the first pass.
        held = set(chunks.young) if step.reason in HOLDING and step.namespace_id else set()
        taken = _taken_back(step, staying | held, done)
        back, ended = chunks.delete(_chunked([n for n in taken if n not in held]))
        aged = [n for n in taken if n in held]
        if aged and ended is None:
            again = _Chunks(run, replace(step, min_age=0.0), fmt, tally, told)
            more, ended = again.delete(_chunked(aged))
            back, young = back + more, again.tried  # (those it reached are no longer kept)
    result = replace(base.done(done + back), overridden=back.files)
    result = replace(result, young=result.young - young)
    return result if ended is None else replace(result, skipped=ended[0], denied=ended[1])


def _chunked(names: list[str]) -> Iterator[list[str]]:
    return (names[i : i + CHUNK] for i in range(0, len(names), CHUNK))


def _unspared(step: GcStep, spare: Spare | None, staying: set[str]) -> Iterator[list[str]]:
    """The step's names in chunks of CHUNK, less those requests reached since the plan
    (`spare`, asked before each chunk; they gather in `staying`)."""
    for i in range(0, len(step.names), CHUNK):
        if spare is not None and step.namespace_id is not None:
            staying.update(spare(step.namespace_id, step.names, i))
        yield [n for n in step.names[i : i + CHUNK] if n not in staying]


_Ended = tuple[str, str | None]  # why a step ended early, and the kernel's refusal if it did


@dataclass
class _Chunks:
    """Deletes a step's names chunk by chunk."""

    run: RunContext
    step: GcStep
    fmt: FileFormat
    tally: _Tally
    told: _Told
    young: set[str] = field(default_factory=set)  # names kept as modified within min_age
    tried: int = 0  # names of the chunks it got to

    def delete(self, chunks: Iterable[list[str]]) -> tuple[DeleteReport, _Ended | None]:
        """Delete these chunks one by one, until a stop; what they did, and why the step
        ended if it did."""
        total = DeleteReport(dry_run=self.run.dry_run)
        for chunk in chunks:
            # The lock first: its wait may be long, and the stop (the fence) must come after it.
            if chunk and not self.run.dry_run and not self.run.recordable():
                return total, (_STOPPED, None)
            if self.run.stop():
                return total, (_STOPPED, None)
            r, ended = self._delete(chunk)
            self.tried += len(chunk)
            total += r
            if ended is not None:
                return total, ended
        return total, None

    def _delete(self, chunk: list[str]) -> tuple[DeleteReport, _Ended | None]:
        """Delete (or stat, in a dry run) one chunk and record it; what it did, and (why the
        step ends, the kernel's refusal) if it ends there."""
        run, step = self.run, self.step
        layout = run.layout
        if not chunk:
            return DeleteReport(dry_run=run.dry_run), None
        gone: dict[str, int | None] = {}
        before = dir_at(layout.root, step.rel_dir)
        # Unpaced here, paced below once the chunk is recorded: a kill -9 during the pacer's
        # sleep (where a paced run spends its time) then finds audit and index exact.
        with self._telling(chunk, gone):
            return self._unlink(chunk, gone, before)

    def _unlink(
        self, chunk: list[str], gone: dict[str, int | None], before: tuple[int, int] | None
    ) -> tuple[DeleteReport, _Ended | None]:
        run, step = self.run, self.step
        layout = run.layout
        try:
            r = delete_files(
                layout.root,
                step.rel_dir,
                chunk,
                dry_run=run.dry_run,
                min_age=step.min_age,
                now=run.clock,
                fmt=self.fmt,
                listeners=Listeners(
                    progress=self.tally.offset(), removed=gone.__setitem__, young=self.young.add
                ),
            )
        except OSError as e:  # an unlink refused: what went before it is recorded all the same
            if not run.dry_run and dir_at(layout.root, step.rel_dir) == before:
                self._record(list(gone), _freed(gone))
            if not is_denied(e):
                raise
            return _freed(gone), (f"denied: {e.strerror}", str(e))
        self.tally.add(r)
        if before is None or dir_at(layout.root, step.rel_dir) != before:
            # A purge renamed the dir away meanwhile: what was unlinked may lie in .trash/
            # and the purge dropped those rows and audited its pages; rows now are the new
            # dir's, so keep them.
            return r, ("the namespace was purged during GC", None)
        if not run.dry_run:
            self._record(list(gone), r)
        _pace(run.pacer, r.files)
        return r, None

    @contextmanager
    def _telling(self, chunk: list[str], gone: dict[str, int | None]) -> Iterator[None]:
        """Tell `unlinking` of the chunk before its unlinks and of what they did after."""
        ns, told = self.step.namespace_id, self.told.unlinking
        if told is None or ns is None or self.run.dry_run:
            yield
            return
        told.expect(ns, chunk)
        try:
            yield
        finally:
            told.settle(ns, chunk, {n for n, size in gone.items() if size is not None})

    def _record(self, gone: list[str], r: DeleteReport) -> None:
        """The chunk's rows dropped and its audit row written; the model told. Those stored
        again since their unlink (the watcher saw the store: Unlinking.again) are on disk:
        their rows and pages stay (the index may have applied that store already)."""
        ns, told = self.step.namespace_id, self.told.unlinking
        if told is not None and ns is not None:
            again = told.again(ns, gone)
            gone = [n for n in gone if n not in again] if again else gone
        _record_chunk(self.run, self.step, gone, r)
        if self.told.recorded is not None and ns is not None:
            self.told.recorded(ns, gone)


_STOPPED = "stopped: shutting down, the GC lease was lost, or the state DB was locked"


def _taken_back(step: GcStep, spared: Collection[str], done: DeleteReport) -> list[str]:
    """Of the step's names spared at execution, those its limit needs after all, tails first:
    as many as the step falls short, less its room (GcStep.room), of what it planned to free
    (in bytes, at its mean page size; in files for a file limit). Files already gone count as
    freed; files another hard link keeps count toward what the cache holds, not the disk."""
    left = [n for n in step.names if n in spared]
    if not left:
        return []
    by_files = step.reason in FILE_LIMITS
    unit = 1.0 if by_files else step.bytes / len(step.names)
    planned = len(step.names) if by_files else step.bytes
    freed = StepResult(step).done(done).toward_limit() + done.vanished * unit
    short = planned - step.room - freed
    return left[: math.ceil(short / unit)] if short > 0 and unit > 0 else []


def _freed(gone: dict[str, int | None]) -> DeleteReport:
    """Files and bytes deleted, from what `delete_files` reported gone (vanished: None)."""
    sizes = [b for b in gone.values() if b is not None]
    return DeleteReport(len(sizes), sum(sizes))


def _pace(pacer: Pacer | None, files: int) -> None:
    """Count `files` deletions on the pacer, sleeping there if they came too fast."""
    if pacer is not None:
        for _ in range(files):
            pacer.tick()


def _record_chunk(run: RunContext, step: GcStep, gone: list[str], r: DeleteReport) -> None:
    """Drop the index rows of a deleted chunk and audit it, in one transaction: whenever a
    kill -9 lands, the audit holds exactly the evictions whose rows left the index."""
    if not (gone or r.files):
        return
    at = run.clock()
    # The index and audit never miss what was deleted; once told, the run deletes no more.
    run.record_deleted(lambda patience: _write_chunk(run, step, gone, r, at, patience=patience))


def _write_chunk(
    run: RunContext,
    step: GcStep,
    gone: list[str],
    r: DeleteReport,
    at: float,
    *,
    patience: float | None,
) -> None:
    """_record_chunk's transaction, waiting `patience` seconds for the write lock."""
    store = run.store
    with store.transaction(patience=patience) as conn:
        if gone and step.namespace_id is not None and step.rel_dir.startswith("ns/"):
            pages_sql.delete_pages(conn, [(step.namespace_id, n) for n in gone])
        if r.files:
            store.audit(
                "evict",
                namespace_id=step.namespace_id,
                reason=step.reason,
                actor=run.actor,
                pages=r.files,
                bytes_=r.bytes,
                at=at,
            )


def _sweep_own_temps(run: RunContext, step: GcStep, base: StepResult) -> StepResult:
    """Delete temps cachemgr's own atomic writes left (gcfind.own_temps), audited as `tmp`."""
    r = delete_own_temps(
        run.layout.root,
        step.rel_dir,
        step.names,
        older_than=step.min_age,
        now=run.clock,
        dry_run=run.dry_run,
    )
    if not run.dry_run:
        _record_chunk(run, step, [], r)  # no index rows: only the audit
    return base.done(r)


def _log_summary(report: GcReport, actor: str) -> None:
    by_reason = {r: {"files": f, "bytes": b} for r, (f, b) in report.totals().items()}
    refused = report.refused_files()
    # A limit not held is a warning as files kept are (docs/gc.md): at INFO it read as done.
    log.log(
        logging.WARNING if refused or not report.held else logging.INFO,
        "gc dry run" if report.dry_run else "gc done",
        extra={
            "actor": actor,
            "files": report.files,
            "bytes": report.bytes,
            "by_reason": by_reason,
            "seconds": round(report.finished_at - report.started_at, 3),
            "held": report.held,
            "refused": refused,
            "warnings": list(report.warnings),
        },
    )
