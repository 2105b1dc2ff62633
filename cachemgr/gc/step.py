"""A GC step (files of one directory to delete for one reason), what carrying it out did, and
a run's report: the shapes the finders, the planner, the executors and the API share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from cachemgr.fs.deletecheck import RefusalReason, files_of, reason_of
from cachemgr.fs.deletion import DeleteReport
from cachemgr.gc.policy import FILE_LIMITS, HOLDING, ByReason, GcReason, tally
from cachemgr.units import human_bytes

_LIMITS: dict[GcReason, str] = {
    "cap": "byte cap",
    "free_space": "free-space floor",
    "files": "file cap",
    "free_inodes": "free-inode floor",
    "dir_full": "directory-entry limit",
}


Unit = Literal["bytes", "files"]


@dataclass(frozen=True)
class Unmet:
    """A limit a plan leaves over its high watermark once everything it may delete is gone:
    nothing else GC knows of may go (pages of a quarantined or damaged namespace, files that
    are not pages, a floor the disk cannot meet even with no cache). The run is not `ok`."""

    reason: GcReason  # which limit (one of HOLDING)
    namespace_id: str | None  # None: the root's
    unit: Unit
    # What would still have to go to bring it to its low watermark (for a floor the filesystem
    # does not meet even with no cache, what beside the cache would have to go too).
    excess: int
    # Why GC did not take it, when it is not that nothing else may go (the state DB could not
    # record a deletion).
    cause: str | None = None

    def line(self) -> str:
        """The warning a run gives for it."""
        scope = "the root's" if self.namespace_id is None else f"ns/{self.namespace_id}'s"
        more = human_bytes(self.excess) if self.unit == "bytes" else f"{self.excess:,} files"
        why = self.cause or "GC has nothing else it may delete"
        return (
            f"{self.reason}: {scope} {_LIMITS.get(self.reason, self.reason)} is not held: it "
            f"stays over its high watermark, {more} more would have to go, and {why} "
            "(`cachemgr doctor` says why)"
        )


@dataclass(frozen=True)
class GcStep:
    """Files of one directory to delete for one reason, in the order to delete them."""

    reason: GcReason
    rel_dir: str  # below the root: ns/<id>, .trash/<entry>, or one of find.OWN_TEMP_DIRS
    namespace_id: str | None  # None: cachemgr's own temps
    names: tuple[str, ...]
    bytes: int  # as the index or the scan saw them
    min_age: float = 0.0  # execution re-checks mtime against this
    remove_dir: bool = False  # the whole directory goes (trash, unbound namespace)
    # Pages a protection (min_age, in flight) held that a limit takes: no check before each
    # chunk of what requests reached since the plan (the limit wins over that too).
    forced: bool = False
    # Of `bytes`, how many pages spared at execution (requests reached them since the plan)
    # may keep without the limit being over its high watermark (policy.room); the rest of
    # what they hold the step takes after all, tails first (cachemgr.gc.execute).
    room: int = 0
    # Files of a step whose names are not listed (a trash entry: its drain lists them).
    count: int | None = None

    @property
    def files(self) -> int:
        """How many files the step deletes (as planned)."""
        return len(self.names) if self.count is None else self.count


@dataclass(frozen=True)
class StepResult:
    """What one step did (or, in a dry run, would do)."""

    step: GcStep
    files: int = 0
    bytes: int = 0
    vanished: int = 0
    young: int = 0
    refused: tuple[str, ...] = ()
    skipped: str | None = None  # why the whole step was not carried out
    denied: str | None = None  # the kernel refused it access (another user's dir): the error
    overridden: int = 0  # pages spared at execution that the step's limit took after all
    linked: int = 0  # of `files`, those another hard link keeps: no byte nor inode freed
    linked_bytes: int = 0  # their size (not in `bytes`, which counts what was freed)

    @property
    def reason(self) -> GcReason:
        return self.step.reason

    @property
    def rel_dir(self) -> str:
        return self.step.rel_dir

    @property
    def namespace_id(self) -> str | None:
        return self.step.namespace_id

    @property
    def planned_files(self) -> int:
        return self.step.files

    @property
    def planned_bytes(self) -> int:
        return self.step.bytes

    def done(self, r: DeleteReport) -> StepResult:
        """This result once `r` is what the step's deletion did."""
        return replace(
            self,
            files=r.files,
            bytes=r.bytes,
            vanished=r.vanished,
            young=r.young,
            refused=r.refused,
            linked=r.linked,
            linked_bytes=r.linked_bytes,
        )

    def toward_limit(self) -> int:
        """What the step did toward its limit, in the limit's unit: a page another hard link
        keeps leaves the cache (its cap, the dir's entries) but frees nothing on the disk (the
        floors)."""
        if self.reason == "cap":
            return self.bytes + self.linked_bytes
        if self.reason == "free_inodes":
            return self.files - self.linked
        return self.files if self.reason in FILE_LIMITS else self.bytes


@dataclass(frozen=True)
class GcReport(ByReason):
    """The outcome of one GC run."""

    dry_run: bool
    leader: bool
    started_at: float
    finished_at: float
    steps: tuple[StepResult, ...] = ()
    warnings: tuple[str, ...] = ()
    holder: str | None = None  # who leads GC when this process does not
    unmet: tuple[Unmet, ...] = ()  # limits the plan could not bring back under (see Unmet)
    # Who held the state DB's write lock that stopped the run deleting (it deletes nothing it
    # cannot record): the run failed (cachemgr.gc.runner raises StateLocked).
    locked_by: str | None = None

    def totals(self) -> dict[GcReason, tuple[int, int]]:
        """(files, bytes) per reason."""
        return tally((s.reason, s.files, s.bytes) for s in self.steps)

    @property
    def overridden(self) -> int:
        """Pages spared at execution that a limit took after all (GcPlan.overridden counts
        those the plan took)."""
        return sum(s.overridden for s in self.steps)

    def refused_files(self) -> dict[RefusalReason, int]:
        """Files kept although the run meant to delete them, per refusal reason."""
        out: dict[RefusalReason, int] = {}
        for step in self.steps:
            for refusal in step.refused:
                out[reason_of(refusal)] = out.get(reason_of(refusal), 0) + files_of(refusal)
        return out

    @property
    def held(self) -> bool:
        """False when a step holding a cap or the floor could not delete what it had to, or
        the plan found too little it may delete to bring a limit back under its high
        watermark: the run did not hold a limit it was asked to hold (not an `ok` run)."""
        refused = any(s.refused for s in self.steps if s.reason in HOLDING)
        return not refused and not self.unmet


# What a page another hard link keeps is (st_nlink > 1): most likely an operator's copy of
# the cache made with `cp -al` (or a backup tool's hard-link snapshot) on the same filesystem.
HARD_LINKS = "hard links another name keeps (st_nlink > 1: a `cp -al` copy on this filesystem?)"


def linked_verdict(
    results: Sequence[StepResult], unmet: tuple[Unmet, ...], warnings: tuple[str, ...]
) -> tuple[tuple[Unmet, ...], tuple[str, ...]]:
    """A run's unmet limits and warnings once its steps ran, if some files they deleted freed
    nothing (another hard link keeps them): a line says so (the bytes reported freed leave
    them out), and the floors count them still to go (_linked_unmet)."""
    files = sum(r.linked for r in results)
    if not files:
        return unmet, warnings
    size = human_bytes(sum(r.linked_bytes for r in results))
    line = (
        f"{files:,} files deleted were {HARD_LINKS}: their {size} and {files:,} inodes were not "
        "freed, and are not counted as freed"
    )
    after = _linked_unmet(results, unmet)
    stale = {u.line() for u in unmet if u not in after}
    said = tuple(w for w in warnings if w not in stale)
    return after, (*said, line, *(u.line() for u in after if u not in unmet))


def _linked_unmet(results: Sequence[StepResult], unmet: tuple[Unmet, ...]) -> tuple[Unmet, ...]:
    """`unmet` once the floors' steps freed less than their plan counted on: what their hard
    links kept still has to go. The plan freed down to the low watermark counting them, so
    the floor is said unmet by that much (a later run's statvfs says whether it is)."""
    out = list(unmet)
    floors: tuple[tuple[GcReason, Unit], ...] = (("free_space", "bytes"), ("free_inodes", "files"))
    for reason, unit in floors:
        steps = [r for r in results if r.reason == reason and r.linked]
        short = sum(r.linked_bytes if unit == "bytes" else r.linked for r in steps)
        if not short:
            continue
        files = sum(r.linked for r in steps)
        cause = f"{files:,} files it deleted were {HARD_LINKS}, which freed nothing"
        at = [i for i, u in enumerate(out) if u.reason == reason and u.namespace_id is None]
        if at:
            out[at[0]] = replace(out[at[0]], excess=out[at[0]].excess + short, cause=cause)
        else:
            out.append(Unmet(reason, None, unit, short, cause))
    return tuple(out)


def joined(floor: GcReport | None, report: GcReport) -> GcReport:
    """One report for a floor pass and the run after it."""
    if floor is None:
        return report
    # The run after the pass plans the floors again, on the disk the pass left: its word is
    # the later one (a floor said unmet twice counted 2 in cachemgr_gc_limits_unmet), also
    # when it deleted for a floor and held it (the pass keeps gc_min_age, the run takes the
    # young pages a floor needs: the pass's unmet made a run that held it exit 1 and count
    # `short`). The pass's lines saying a floor unmet, or short of its low watermark, go with
    # its word (a held report said "576 files short of the inode floor's low watermark").
    later = {_limit(u) for u in report.unmet}
    later |= {(reason, None) for reason, (files, _) in report.totals().items() if files}
    unmet = tuple(u for u in floor.unmet if _limit(u) not in later)
    said = {u.line() for u in floor.unmet if u not in unmet}
    said |= {w for w in floor.warnings for r, _ in later if w.startswith(short_of(r))}
    warnings = [w for w in floor.warnings if w not in said] + list(report.warnings)
    return replace(
        report,
        started_at=floor.started_at,
        steps=floor.steps + report.steps,
        warnings=tuple(dict.fromkeys(warnings)),  # each said once
        unmet=report.unmet + unmet,
        locked_by=report.locked_by or floor.locked_by,
    )


def short_of(reason: str) -> str:
    """How the floor pass's line saying it is short of a floor's low watermark begins."""
    return f"{reason}: short of the low watermark by "


def _limit(unmet: Unmet) -> tuple[str, str | None]:
    return unmet.reason, unmet.namespace_id
