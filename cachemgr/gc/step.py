"""A GC step (files of one directory to delete for one reason), what carrying it out did, and
a run's report: the shapes the finders, the planner, the executors and the API share."""

from __future__ import annotations

from dataclasses import dataclass, replace

from cachemgr.fs.deletion import DeleteReport
from cachemgr.gc.policy import ByReason, GcReason, tally


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
        return len(self.step.names)

    @property
    def planned_bytes(self) -> int:
        return self.step.bytes

    def done(self, r: DeleteReport) -> StepResult:
        """This result once `r` is what the step's deletion did."""
        return replace(
            self, files=r.files, bytes=r.bytes, vanished=r.vanished, young=r.young,
            refused=r.refused,
        )  # fmt: skip


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

    def totals(self) -> dict[GcReason, tuple[int, int]]:
        """(files, bytes) per reason."""
        return tally((s.reason, s.files, s.bytes) for s in self.steps)
