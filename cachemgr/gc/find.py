"""What GC may delete besides LRU pages: trash leftovers, stale temps, unbound namespaces, torn
pages. Each finder is read-only and returns the steps that would delete what it found."""

from __future__ import annotations

import os
import sqlite3
import stat
from collections import Counter, defaultdict
from collections.abc import Collection, Mapping
from contextlib import suppress
from dataclasses import dataclass, replace

from cachemgr.backends import FileFormat, FileKind
from cachemgr.errors import UnsafePathError
from cachemgr.formats import DEFAULT_FORMAT
from cachemgr.fs.dirscan import TEMPS, Listed, list_files, usual_size
from cachemgr.fs.safe import is_own_temp, open_dir
from cachemgr.gc.policy import GcPolicy, GcReason
from cachemgr.gc.step import GcStep
from cachemgr.layout import Layout
from cachemgr.ns import registry as nsreg
from cachemgr.ns.manifest import format_of
from cachemgr.ns.trash import left_note, list_trash, recorded_count, scan_entry, trash_format
from cachemgr.state import pages_sql


@dataclass(frozen=True)
class TempFile:
    """An engine's temp file found in a namespace dir (a path below it for a nested format)."""

    namespace_id: str
    name: str
    size: int
    mtime: float

    @property
    def where(self) -> str:
        return f"ns/{self.namespace_id}"


def list_namespace(layout: Layout, ns_id: str) -> tuple[dict[str, Listed], list[TempFile]]:
    """Pages (by name) and temp files of one namespace dir; others are ignored."""
    pages: dict[str, Listed] = {}
    temps: list[TempFile] = []
    for f in list_files(layout, f"ns/{ns_id}", fmt=format_of(layout, ns_id)):
        if f.kind is FileKind.PAGE:
            pages[f.name] = f
        else:
            temps.append(TempFile(ns_id, f.name, f.size, f.mtime))
    return pages, temps


def left_alone(layout: Layout, warnings: list[str]) -> set[str]:
    """Namespaces GC leaves alone whole (a bad manifest; a symlink, a file or a mount point in
    place of the dir), each said in `warnings`."""
    damaged = nsreg.damaged(layout)
    warnings += [f"ns/{ns} left alone ({state}): {why}" for ns, (state, why) in damaged.items()]
    return set(damaged)


def list_temps(layout: Layout, ns_id: str, warnings: list[str]) -> list[TempFile]:
    """The temp files of one namespace dir (pages are named, not stat'ed: a sweep is cheap);
    none, with a warning, if the dir is no longer a safe one or this user may not read it
    (another user's: the index holds it aside, cachemgr.ns.quarantine)."""
    try:
        temps = list(list_files(layout, f"ns/{ns_id}", TEMPS, format_of(layout, ns_id)))
    except (UnsafePathError, PermissionError) as e:
        warnings.append(f"ns/{ns_id} not swept: {e}")
        return []
    return [TempFile(ns_id, f.name, f.size, f.mtime) for f in temps]


OWN_TEMP_DIRS = (".", "ns")  # where write_atomic_at writes below the root (CACHEDIR.TAG, manifests)


@dataclass(frozen=True)
class OwnTemp:
    """A temp file cachemgr's own atomic write left (a kill -9 between write and rename)."""

    rel_dir: str  # one of OWN_TEMP_DIRS
    name: str
    size: int
    mtime: float

    @property
    def where(self) -> str:
        return self.rel_dir


def own_temps(layout: Layout) -> list[OwnTemp]:
    """cachemgr's own temp files below the root that are regular files (nothing followed)."""
    found = []
    for rel in OWN_TEMP_DIRS:
        try:
            with open_dir(layout.root, rel) as fd, os.scandir(fd) as entries:
                for entry in entries:
                    if not is_own_temp(entry.name):
                        continue
                    with suppress(FileNotFoundError):
                        st = entry.stat(follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode):
                            found.append(OwnTemp(rel, entry.name, st.st_size, st.st_mtime))
        except FileNotFoundError:
            continue
    return found


def trash_leftovers(
    layout: Layout,
    warnings: list[str],
    counts: TrashCounts | None = None,
    recorded: Mapping[str, tuple[int, int]] | None = None,
) -> list[GcStep]:
    """A step for each purged namespace in .trash/ (purges not finished yet): its page and
    temp files, counted (`recorded`: what the purges recorded, less what drains deleted
    since; `counts`: the others, as the daemon's runs know them), not listed: its drain
    lists them (cachemgr.ns.trash.drain_entry)."""
    found: list[GcStep] = []
    try:
        entries = list_trash(layout)  # the entries trash.drain_entry deletes; others stay
    except UnsafePathError as e:
        warnings.append(f".trash not drained: {e}")
        return found
    counts = counts if counts is not None else TrashCounts()
    counts.keep(entries)
    for entry in entries:
        try:
            count = counts.of(layout, entry, recorded or {})
        except UnsafePathError as e:  # a symlink or a file: left for a person, reported
            warnings.append(f".trash/{entry} skipped: {e}")
            continue
        if count is None:
            continue  # drained (by another process) since it was listed
        if count.note:  # deletion leaves them, and with them the entry: say so on every run
            warnings.append(f".trash/{entry}: {count.note}")
        ns_id = entry.partition(".")[0]
        rel = f".trash/{entry}"
        found.append(
            GcStep("trash", rel, ns_id, (), count.bytes, remove_dir=True, count=count.files)
        )
    return found


@dataclass(frozen=True)
class TrashCount:
    """What one trash entry holds for its drain to delete, and what the drain leaves."""

    files: int
    bytes: int
    note: str | None  # its foreign names (left for a person), said on every run


class TrashCounts:
    """Each trash entry's count, scanned once and then less what runs drained of it. A plan
    listed every file of every entry: 7 s at 200,000 files (37 us a file, the test suite
    running beside it), and a run that yields to a limit (cachemgr.gc.runner) plans again at
    once. Nothing writes into a trash entry but its drains; another process draining one
    leaves its count high until the entry is gone."""

    def __init__(self) -> None:
        self._known: dict[str, TrashCount | None] = {}

    def of(
        self, layout: Layout, entry: str, recorded: Mapping[str, tuple[int, int]]
    ) -> TrashCount | None:
        """The entry's count (None: it is gone): as `recorded`, else a scan if it is not known
        yet. A recorded count names no foreign file: the drain that ends it forgets it, and
        the scan of what is left then does (cachemgr.state.trash_sql)."""
        if entry in recorded:  # kept by every process's drains: never counted down here
            self._known.pop(entry, None)
            try:
                return TrashCount(*recorded_count(layout, entry, recorded), note=None)
            except FileNotFoundError:
                return None
        if entry not in self._known:
            self._known[entry] = _count(layout, entry)
        return self._known[entry]

    def drained(self, entry: str, files: int, size: int) -> None:
        """A run deleted (or found gone) this many files and bytes of the entry."""
        known = self._known.get(entry)
        if known is not None:
            left = replace(
                known, files=max(0, known.files - files), bytes=max(0, known.bytes - size)
            )
            self._known[entry] = left

    def keep(self, entries: Collection[str]) -> None:
        """Forget the entries no longer in .trash/."""
        self._known = {e: c for e, c in self._known.items() if e in entries}


def _count(layout: Layout, entry: str) -> TrashCount | None:
    scanned = scan_entry(layout, entry)
    if scanned is None:
        return None
    usage, example = scanned
    note = left_note(usage.other, example) if usage.other else None
    return TrashCount(usage.files + usage.temps, usage.bytes + usage.temp_bytes, note)


def step_format(layout: Layout, step: GcStep) -> FileFormat:
    """The file format of the dir a step deletes in (a namespace's, or a trash entry's)."""
    if step.rel_dir.startswith(".trash/"):
        return trash_format(layout, step.rel_dir.removeprefix(".trash/"))
    return format_of(layout, step.namespace_id) if step.namespace_id else DEFAULT_FORMAT


def stale_temps(temps: list[TempFile], policy: GcPolicy, now: float) -> list[GcStep]:
    """Temp files older than tmp_ttl, grouped by namespace (a crashed writer's leftovers)."""
    by_ns: dict[str, list[TempFile]] = defaultdict(list)
    for t in temps:
        if now - t.mtime >= policy.tmp_ttl:
            by_ns[t.namespace_id].append(t)
    return [
        GcStep(
            "tmp",
            f"ns/{ns}",
            ns,
            tuple(t.name for t in ts),
            sum(t.size for t in ts),
            _temp_age(policy),
        )
        for ns, ts in sorted(by_ns.items())
    ]


def stale_own_temps(own: list[OwnTemp], policy: GcPolicy, now: float) -> list[GcStep]:
    """cachemgr's own temps older than tmp_ttl, per dir; `namespace_id` None marks them."""
    by_dir: dict[str, list[OwnTemp]] = defaultdict(list)
    for t in own:
        if now - t.mtime >= policy.tmp_ttl:
            by_dir[t.rel_dir].append(t)
    return [
        GcStep(
            "tmp",
            rel,
            None,
            tuple(sorted(t.name for t in ts)),
            sum(t.size for t in ts),
            _temp_age(policy),
        )
        for rel, ts in sorted(by_dir.items())
    ]


def _temp_age(policy: GcPolicy) -> float:
    """The age a temp must still have when deleted: a writer may have touched it since."""
    return max(policy.tmp_ttl, policy.min_age)


def unbound_past_retention(
    conn: sqlite3.Connection, policy: GcPolicy, now: float
) -> list[tuple[str, GcReason]]:
    """Namespaces no instance is bound to, beyond keep_unbound or idle past unbound_ttl.

    Oldest first. Idle time counts from the last activity the registry or the index saw, and
    a namespace idle for less than min_age is never dropped (an init step may bind it next).
    """
    rows = pages_sql.unbound_by_activity(conn)
    doomed: list[tuple[str, GcReason]] = []
    for rank, (ns_id, active) in enumerate(rows):
        idle = now - active
        if idle < policy.min_age:
            continue
        if policy.unbound_ttl is not None and idle > policy.unbound_ttl:
            doomed.append((ns_id, "ttl"))
        elif rank >= policy.keep_unbound:
            doomed.append((ns_id, "unbound"))
    return doomed[::-1]


def torn_pages(
    conn: sqlite3.Connection, skip: set[str], policy: GcPolicy, now: float
) -> tuple[list[GcStep], list[str]]:
    """Pages with a file whose size differs from the size most files of its kind have.

    A truncated or foreign-dtype page poisons its prefix for good: SGLang's get() fails on it
    and set() never rewrites a file that exists (FIELD_NOTES §5); deleting it heals the cache.
    The page goes whole (its other files are useless without it). A kind (what follows the
    key: pool, model, ranks) without a clear majority size is reported, not touched.
    """
    mixed = pages_sql.namespaces_with_mixed_sizes(conn)
    found: list[GcStep] = []
    warnings: list[str] = []
    before = now - policy.min_age
    for ns_id in mixed:
        if ns_id in skip:
            continue
        kinds: dict[str, list[tuple[str, int]]] = defaultdict(list)  # kind -> (key, size)
        pages: dict[str, list[tuple[str, int, float]]] = defaultdict(list)  # key -> files
        for name, size, last, key_len in pages_sql.namespace_files(conn, ns_id):
            # a nested page's top dir is part of its kind (vLLM: another digest, another size)
            top = name.partition("/")[0] if "/" in name else ""
            kinds[top + name[key_len:]].append((name[:key_len], size))
            pages[name[:key_len]].append((name, size, last))
        torn: set[str] = set()  # keys
        for kind, files in sorted(kinds.items()):
            sizes = Counter(s for _, s in files)
            if len(sizes) == 1:
                continue
            usual = usual_size(sizes, len(files))
            if usual is None:
                warnings.append(f"ns/{ns_id}: pages *{kind} have mixed sizes; none removed")
                continue
            torn |= {key for key, s in files if s != usual}
        doomed = sorted(
            f
            for key in torn
            if max(last for _, _, last in pages[key]) <= before
            for f in pages[key]
        )
        if doomed:
            names = tuple(n for n, _, _ in doomed)
            size = sum(s for _, s, _ in doomed)
            found.append(GcStep("corrupt", f"ns/{ns_id}", ns_id, names, size, policy.min_age))
    return found, warnings
