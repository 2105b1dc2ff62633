"""What an earlier pass of the same GC run does, as the plan after it counts it: the floor
pass's files (planned in a dry run) counted gone, and the pages the kernel refused to a step
holding a limit, which the next plan leaves (cachemgr.gc.runner plans once more around them).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from cachemgr.fs.usage import DiskUsage
from cachemgr.gc.policy import HOLDING
from cachemgr.gc.step import GcReport, GcStep


@dataclass(frozen=True)
class Earlier:
    """What an earlier pass of the same run deletes first (the floor pass's, planned in a dry
    run): the plan counts its files as gone and their bytes as free, as the real run finds the
    disk after that pass (by file sizes, not the blocks they held)."""

    files: frozenset[tuple[str, str]] = frozenset()  # (rel_dir, name)
    dirs: frozenset[str] = frozenset()  # the dirs it removes whole (trash entries)
    by_namespace: tuple[tuple[str, int], ...] = ()  # page bytes of each namespace's steps
    unlisted: int = 0  # files of its steps counted, not named (trash entries): inodes freed
    kept: frozenset[tuple[str, str]] = frozenset()  # (namespace, name): refused, not picked

    @classmethod
    def of(cls, steps: Sequence[GcStep]) -> Earlier:
        """The files these steps delete."""
        by_ns: dict[str, int] = {}
        for s in steps:
            if s.namespace_id is not None and s.rel_dir.startswith("ns/"):
                by_ns[s.namespace_id] = by_ns.get(s.namespace_id, 0) + s.bytes
        return cls(
            frozenset((s.rel_dir, n) for s in steps for n in s.names),
            frozenset(s.rel_dir for s in steps if s.remove_dir),
            tuple(sorted(by_ns.items())),
            sum(s.count for s in steps if s.count is not None),
        )

    def then(self, report: GcReport) -> Earlier:
        """What is done once `report`'s run is too: the pages the kernel refused to a step
        holding a limit are not picked again (their files stay, and count), and a dry run's
        other files count as gone (a real run's are gone from the index). Not where the step
        deleted none: then its dir refuses them all (not writable, append-only), and so would
        it every other page (the quarantine holds such a namespace aside)."""
        kept = {
            (r.namespace_id, n)
            for r in report.steps
            if r.reason in HOLDING and r.files
            for n in r.kept
        }
        more = self.kept | {(ns, n) for ns, n in kept if ns is not None}
        if not report.dry_run:
            return replace(self, kept=more)
        done = Earlier.of(
            [
                replace(r.step, names=_less(r.step.names, r.kept), bytes=r.bytes)
                for r in report.steps
            ]
        )
        bytes_by_ns = dict(self.by_namespace)
        for ns, b in done.by_namespace:
            bytes_by_ns[ns] = bytes_by_ns.get(ns, 0) + b
        return Earlier(
            self.files | done.files,
            self.dirs | done.dirs,
            tuple(sorted(bytes_by_ns.items())),
            self.unlisted + done.unlisted,
            more,
        )

    def freed(self, disk: DiskUsage, trash: int) -> DiskUsage:
        """`disk` once these files (and `trash` bytes of trash entries) are gone."""
        gone = sum(b for _, b in self.by_namespace) + trash
        return disk._replace(used=disk.used - gone, free=disk.free + gone)

    def without(self, step: GcStep, sizes: dict[str, int]) -> GcStep:
        """`step` less the files deleted before it (`sizes`: its files' bytes)."""
        names = tuple(n for n in step.names if (step.rel_dir, n) not in self.files)
        return replace(step, names=names, bytes=sum(sizes.get(n, 0) for n in names))


NOTHING_EARLIER = Earlier()  # a run with no pass before its plan


def _less(names: Sequence[str], kept: Collection[str]) -> tuple[str, ...]:
    return tuple(n for n in names if n not in kept)
