"""GC policy: the limits from the settings, and how much must go to respect them."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Literal, NamedTuple, Protocol

from cachemgr.fs.dirlimit import flat_dir_index
from cachemgr.fs.usage import DiskUsage
from cachemgr.settings import Settings

# Why GC deletes a file: the metric label and the audit reason of an eviction (a purge has
# its own reasons, ns.purge.PurgeReason: why a whole namespace was renamed away).
# files: a file-count cap; free_inodes: the inode floor; dir_full: a flat namespace dir near
# its filesystem's entry limit (cachemgr.fs.dirlimit).
GcReason = Literal[
    "trash",
    "tmp",
    "ttl",
    "unbound",
    "corrupt",
    "cap",
    "free_space",
    "files",
    "free_inodes",
    "dir_full",
]
# Evictions that hold a limit while the server writes: they keep pace with it (unpaced).
HOLDING: frozenset[GcReason] = frozenset({"cap", "free_space", "files", "free_inodes", "dir_full"})
FILE_LIMITS: frozenset[GcReason] = frozenset({"files", "free_inodes", "dir_full"})  # (in files)
# Of a flat dir's entry limit, the file cap GC keeps by default: its high watermark then
# stays under the 80% at which doctor and the alert warn.
DIR_CAP_SHARE = 0.8


class EntryLimit(Protocol):
    """How many entries one flat dir takes, by the length of their names
    (cachemgr.fs.dirlimit.DirIndex; a test's fixed number)."""

    def limit(self, name_len: int = ...) -> int | None: ...


@dataclass(frozen=True)
class GcPolicy:
    """The GC limits in plain numbers (bytes, seconds); built from Settings or by a test."""

    max_bytes: int | None = None
    namespace_max_bytes: int | None = None
    min_free_bytes: int = 0
    min_free_percent: float = 0.0
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    keep_unbound: int = 2
    unbound_ttl: float | None = 7 * 86400.0
    tmp_ttl: float = 3600.0
    min_age: float = 0.0
    interval: float = 60.0
    sweep_interval: float = 3600.0
    delete_rate: float | None = 2000.0
    max_files: int | None = None
    namespace_max_files: int | None = None
    min_free_inodes_percent: float = 0.0
    # The root's filesystem: how many entries a flat dir takes there (None: no known limit).
    dir_entries: EntryLimit | None = None

    @classmethod
    def from_settings(
        cls, s: Settings, *, dir_index: Callable[[Path], EntryLimit | None] = flat_dir_index
    ) -> GcPolicy:
        """The policy the settings describe, with the flat-dir entry limit of the root's
        filesystem (`dir_index`)."""
        ttl = s.gc_unbound_ttl
        return cls(
            max_bytes=int(s.gc_max_bytes) if s.gc_max_bytes is not None else None,
            namespace_max_bytes=(
                int(s.gc_namespace_max_bytes) if s.gc_namespace_max_bytes is not None else None
            ),
            min_free_bytes=int(s.gc_min_free_bytes),
            min_free_percent=s.gc_min_free_percent,
            high_watermark=s.gc_high_watermark,
            low_watermark=s.gc_low_watermark,
            keep_unbound=s.gc_keep_unbound,
            unbound_ttl=ttl.total_seconds() if ttl is not None else None,
            tmp_ttl=s.gc_tmp_ttl.total_seconds(),
            min_age=s.gc_min_age.total_seconds(),
            interval=s.gc_interval.total_seconds(),
            sweep_interval=s.gc_sweep_interval.total_seconds(),
            delete_rate=s.gc_delete_rate,
            max_files=s.gc_max_files,
            namespace_max_files=s.gc_namespace_max_files,
            min_free_inodes_percent=s.gc_min_free_inodes_percent,
            dir_entries=dir_index(s.root),
        )

    def floor(self, disk: DiskUsage) -> int:
        """Bytes that must stay free on the filesystem."""
        return max(self.min_free_bytes, math.ceil(disk.total * self.min_free_percent / 100))

    def inode_floor(self, inodes: Inodes) -> int:
        """Inodes that must stay free on the filesystem."""
        return math.ceil(inodes.total * self.min_free_inodes_percent / 100)


class Inodes(NamedTuple):
    """A filesystem's inodes (statvfs f_files, f_favail)."""

    total: int
    free: int


class Files(NamedTuple):
    """What the file-count limits are checked against: files per namespace (page files the
    index counts), the namespaces whose pages sit in one dir (with their page names' length),
    and the filesystem's inodes."""

    live: Mapping[str, int]
    flat: Mapping[str, int] = MappingProxyType({})
    inodes: Inodes | None = None
    ahead: int = 0  # files the writer stores before GC is done (the root's budget counts them)
    # Files per namespace GC leaves alone (damaged): under the root's limits, never evicted.
    kept: Mapping[str, int] = MappingProxyType({})
    # Entries of each flat namespace dir that are not page files (temps, foreign files, at
    # the last scan): they fill its entry limit as pages do, but only pages may go.
    others: Mapping[str, int] = MappingProxyType({})

    def used(self) -> int:
        """The page files the root's limits count."""
        return sum(self.live.values()) + sum(self.kept.values())

    def with_writer(self, bytes_ahead: int, live_bytes: Mapping[str, int]) -> Files:
        """These counts with the writer's bytes to come (over_limits' `ahead` and `pending`)
        as files, at the index's mean page file size."""
        files, size = sum(self.live.values()), sum(live_bytes.values())
        return self._replace(ahead=math.ceil(bytes_ahead * files / size) if size else 0)


class Budget(NamedTuple):
    """How many bytes the root's pages may use, and which limit sets it."""

    limit: float  # math.inf when nothing limits the root
    reason: GcReason

    def over(self, used: int, high: float) -> bool:
        return used > self.limit * high

    def excess(self, used: int, low: float) -> int:
        """Bytes to evict to get from `used` down to the low watermark."""
        return max(0, used - math.floor(max(self.limit, 0) * low))

    def shortfall(self, used: int, low: float) -> int:
        """As excess, but a negative limit (a floor the filesystem does not meet even with no
        cache) counts whole: what would have to go, of the cache or beside it."""
        return used - math.floor(min(self.limit, self.limit * low))


def headroom(policy: GcPolicy, used: int, disk: DiskUsage, *, ahead: int = 0) -> float:
    """Bytes that may still be stored before the root's budget passes its high watermark
    (math.inf without a limit): what the watcher may see stored before it wakes GC."""
    budget = root_budget(policy, used, disk)
    if budget.limit == math.inf:
        return math.inf
    return budget.limit * policy.high_watermark - used - _bounded(policy, budget, ahead, 1.0)


def _bounded(policy: GcPolicy, budget: Budget, ahead: int, share: float) -> int:
    """The writer's predicted bytes, at most `share` of the watermarks' gap."""
    if budget.limit == math.inf:
        return ahead
    # A floor the disk cannot meet even empty gives a negative budget: no gap, not a negative
    # one (which took the writer's bytes off the excess, and a run planned nothing to free).
    gap = max(budget.limit, 0) * (policy.high_watermark - policy.low_watermark)
    return min(ahead, round(gap * share))


def room(policy: GcPolicy, limit: float, ahead: int = 0) -> int:
    """Of the bytes a run over a byte `limit` frees down to the low watermark (deeper by half
    the writer's `ahead`, see over_limits), those that may stay without the limit being over
    its high watermark (with all of `ahead`) once the run is done: what pages requests reached
    while it deleted may keep (cachemgr.gc.execute). About the watermarks' gap, half that at a
    writer's full pace."""
    if limit == math.inf:
        return 0
    budget = Budget(limit, "cap")
    top, low = max(limit, 0) * policy.high_watermark, max(limit, 0) * policy.low_watermark
    writer = _bounded(policy, budget, ahead, 1.0) - _bounded(policy, budget, ahead, 0.5)
    return max(0, math.floor(top) - math.floor(low) - writer)


def root_budget(policy: GcPolicy, used: int, disk: DiskUsage) -> Budget:
    """The root's byte budget: its cap, or what the free-space floor leaves, whichever is less.

    The cache may grow while the filesystem keeps `floor` bytes free, so the floor acts as a
    cap of used + free - floor; the same watermarks then apply to both limits.
    """
    space = used + disk.free - policy.floor(disk) if policy.floor(disk) > 0 else math.inf
    cap = policy.max_bytes if policy.max_bytes is not None else math.inf
    if space < cap:
        return Budget(space, "free_space")
    return Budget(cap, "cap")


class Limits(NamedTuple):
    """What is over which limit, and by how much: the bytes to evict to get back down to the
    low watermark, for each limit over its high watermark."""

    namespaces: dict[str, int]  # namespace -> excess over its cap; only those over it
    budget: Budget  # the root's
    root: int | None  # excess over the root's budget; None: under its high watermark
    # The same in files: namespace -> (files to evict, the cap's reason), and the root's.
    namespace_files: Mapping[str, tuple[int, GcReason]] = MappingProxyType({})
    files_budget: Budget = Budget(math.inf, "files")
    root_files: int | None = None


def over_limits(
    policy: GcPolicy,
    live: Mapping[str, int],
    disk: DiskUsage,
    *,
    counted: int | None = None,
    ahead: int = 0,
    pending: int = 0,
    files: Files | None = None,
    kept: int = 0,
) -> Limits:
    """The limits `live` (page bytes per namespace GC may evict from) is over.

    The root budget counts `counted` bytes as used (by default all of `live`): the plan also
    counts what it deletes otherwise (dropped namespaces, trash, temps), which is free space
    to come. `pending`: bytes already stored that the index does not count yet (the watcher
    saw them, the index has not applied them); `ahead`: bytes the writer will add while GC
    frees space (the daemon's estimate). Both count against the root's budget so the cap holds
    while it writes. `files`: the file counts the file caps and the inode floor are kept on,
    with the same watermarks. `kept`: bytes of namespaces GC leaves alone (damaged): on disk
    and under the root's limits like any page, but never evicted, so others' pages go. Pure
    arithmetic on aggregates: the cheap check and the plan both use it.
    """
    cap, high, low = policy.namespace_max_bytes, policy.high_watermark, policy.low_watermark
    over_cap: dict[str, int] = {}
    if cap is not None:
        over_cap = {ns: b - int(cap * low) for ns, b in sorted(live.items()) if b > cap * high}
    left = sum(live.values())
    budget = root_budget(policy, (left + kept if counted is None else counted) + pending, disk)
    used = left + pending + kept  # pending, kept: on disk already
    # The writer's pace starts a run up to a whole gap early, but deepens it by at most half
    # the gap: a run must not empty the cache for a burst.
    over = budget.over(used + _bounded(policy, budget, ahead, 1.0), high)
    root = budget.excess(used + _bounded(policy, budget, ahead, 0.5), low) if over else None
    if files is None:
        return Limits(over_cap, budget, root)
    by_ns, files_budget, root_files = over_file_limits(policy, files)
    return Limits(over_cap, budget, root, by_ns, files_budget, root_files)


def over_file_limits(
    policy: GcPolicy, files: Files
) -> tuple[dict[str, tuple[int, GcReason]], Budget, int | None]:
    """over_limits in files: each namespace over its file cap (a flat one's, see
    namespace_file_limits), and the root's file budget (its cap, or what the inode floor leaves) and
    excess. A page file is one inode: freeing n files frees n inodes."""
    high, low = policy.high_watermark, policy.low_watermark
    by_ns: dict[str, tuple[int, GcReason]] = {}
    for ns, n in sorted(files.live.items()):
        excess = [
            (counted - math.floor(cap * low), reason)
            for cap, reason, counted in namespace_file_limits(policy, files, ns, n)
            if counted > cap * high
        ]
        if excess:  # the one that needs most to go (at a tie, the entry limit says why)
            by_ns[ns] = max(excess, key=lambda o: (o[0], o[1] == "dir_full"))
    used = files.used()
    budget = Budget(policy.max_files if policy.max_files is not None else math.inf, "files")
    floor = policy.inode_floor(files.inodes) if files.inodes is not None else 0
    if files.inodes is not None and floor > 0:
        space = used + files.inodes.free - floor
        if space < budget.limit:
            budget = Budget(space, "free_inodes")
    # As for bytes: the writer's pace starts a run up to a gap early, deepens it by half one.
    over = budget.over(used + _bounded(policy, budget, files.ahead, 1.0), high)
    root = budget.excess(used + _bounded(policy, budget, files.ahead, 0.5), low) if over else None
    return by_ns, budget, root


def namespace_file_limits(
    policy: GcPolicy, files: Files, ns: str, n: int
) -> list[tuple[float, GcReason, int]]:
    """The file limits of namespace `ns` holding `n` page files: (limit, reason, what counts
    against it). Its file cap counts its pages; a flat dir's entry limit (DIR_CAP_SHARE of
    it) counts every entry, its other files too: a dir whose foreign files filled it refused
    the server's stores with ENOSPC while GC, counting pages, saw it under its cap."""
    out: list[tuple[float, GcReason, int]] = []
    if policy.namespace_max_files is not None:
        out.append((policy.namespace_max_files, "files", n))
    name_len = files.flat.get(ns)
    if name_len is not None and policy.dir_entries is not None:
        limit = policy.dir_entries.limit(name_len)
        if limit is not None:
            out.append((int(limit * DIR_CAP_SHARE), "dir_full", n + files.others.get(ns, 0)))
    return out


def files_over(policy: GcPolicy, files: Files) -> bool:
    """Whether any file cap, or the inode floor, is over its high watermark."""
    by_ns, _, root = over_file_limits(policy, files)
    return bool(by_ns) or root is not None


class ByReason:
    """Totals of a GC plan or report, from its `totals()`: (files, bytes) per reason."""

    def totals(self) -> dict[GcReason, tuple[int, int]]:
        raise NotImplementedError

    @property
    def files(self) -> int:
        return sum(f for f, _ in self.totals().values())

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.totals().values())


def tally(rows: Iterable[tuple[GcReason, int, int]]) -> dict[GcReason, tuple[int, int]]:
    """(files, bytes) per reason, in first-seen order, from (reason, files, bytes) rows."""
    out: dict[GcReason, tuple[int, int]] = {}
    for reason, files, size in rows:
        f, b = out.get(reason, (0, 0))
        out[reason] = (f + files, b + size)
    return out
