"""The trash: namespaces a purge renamed into <root>/.trash/, deleted later through deletion.py.

Deletion runs in the foreground (CLI, with progress), in a thread (the daemon, paced), or on
any later run: whatever a crash or a kill -9 left behind is simply deleted again. Each entry
that is finished gets one audit row `delete-trash` with the pages/bytes actually deleted.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Literal

from cachemgr.backends import FileFormat, FileKind
from cachemgr.errors import StateLocked, UnsafePathError
from cachemgr.formats import DEFAULT_FORMAT
from cachemgr.fs.deletion import LISTED, DeleteReport, Listeners, Pacer, delete_dir
from cachemgr.fs.dirscan import Usage, scan_usage
from cachemgr.fs.safe import open_dir
from cachemgr.fs.tree import format_in, tree_chunks
from cachemgr.layout import Layout
from cachemgr.ns.purge_intent import settle_entry, trash_counts
from cachemgr.ns.runcontext import RunContext, unheeded
from cachemgr.state import trash_sql
from cachemgr.state.store import Store

Actor = Literal["cli", "http", "auto"]
log = logging.getLogger(__name__)
# <ns id>.<unique>: what purge.py names an entry; anything else in .trash/ is a person's.
TRASH_RE = re.compile(r"(?P<ns>[0-9a-f]{16})\.(?P<unique>[0-9a-z]{1,40})")


def list_trash(layout: Layout) -> list[str]:
    """Names in .trash/ that a purge put there (anything else is left for a person).

    UnsafePathError if .trash/ itself is a symlink or not a directory."""
    try:
        with open_dir(layout.root, ".trash") as fd:
            return sorted(n for n in os.listdir(fd) if TRASH_RE.fullmatch(n))
    except FileNotFoundError:
        return []


@dataclass(frozen=True)
class TrashEntry:
    """One purged namespace waiting in .trash/ to be deleted."""

    name: str
    ns_id: str
    pages: int
    bytes: int
    problem: str | None = None  # why it cannot be deleted (a symlink), if it cannot
    foreign: int = 0  # names that are not SGLang's pages or temps: deletion leaves them
    example: str | None = None  # the full path of one of them

    @property
    def left_for_a_person(self) -> str | None:
        """What stops cachemgr finishing this entry, said for the person who must, or None."""
        return left_note(self.foreign, self.example) if self.foreign else None


def left_note(foreign: int, example: str | None) -> str:
    """`left for a person: 2 foreign files, e.g. <path>`: the one wording everywhere."""
    files = "file" if foreign == 1 else "files"
    return f"left for a person: {foreign:,} foreign {files}, e.g. {example}"


def scan_entry(layout: Layout, entry: str) -> tuple[Usage, str | None] | None:
    """What .trash/<entry> holds (None: it is gone), and the full path of one name in it that
    deletion leaves, if any (UnsafePathError: a symlink or a file in its place)."""
    usage = scan_usage(layout, f".trash/{entry}", trash_format(layout, entry))
    if usage is None:
        return None
    return usage, _foreign_example(layout, entry) if usage.other else None


def _foreign_example(layout: Layout, entry: str) -> str | None:
    try:
        with open_dir(layout.root, f".trash/{entry}") as fd:
            fmt = format_in(fd)
            names: Iterable[str] = chain.from_iterable(tree_chunks(fd, fmt, LISTED, set()))
            if fmt.nesting is not None:  # what stays above the blocks: the identity files
                tops = [d.name for d in os.scandir(fd) if d.is_dir(follow_symlinks=False)]
                names = chain(names, (str(Path(t, fmt.nesting.identity_file)) for t in tops))
            for name in names:
                if _left_alone(layout.trash / entry, name, fmt):
                    return str(layout.trash / entry / name)
    except FileNotFoundError:
        return None  # finished (or moved) since it was counted
    # Not in the dirs deletion walks (a name between a vLLM rank dir and its block dirs): the
    # first such name anywhere in the entry, so the note never says "e.g. None".
    return _first_left_alone(layout.trash / entry, fmt)


def _left_alone(top: Path, rel: str, fmt: FileFormat) -> bool:
    """Whether deletion leaves `rel` below `top`: a foreign name, or not a regular file."""
    try:
        mode = os.lstat(top / rel).st_mode
    except FileNotFoundError:
        return False  # a rank dir has no identity file; a file deleted since it was listed
    return fmt.classify_path(rel) is FileKind.FOREIGN or not stat.S_ISREG(mode)


def _first_left_alone(top: Path, fmt: FileFormat) -> str | None:
    """The first name below `top` deletion leaves, by a walk that never follows a link nor
    enters another mount (a bind mount is not the entry's)."""
    dev = os.lstat(top).st_dev
    for here, dirs, files in os.walk(top):
        links = [d for d in dirs if os.path.islink(os.path.join(here, d))]
        dirs[:] = sorted(d for d in dirs if os.lstat(os.path.join(here, d)).st_dev == dev)
        for name in sorted(files) + links:
            rel = os.path.relpath(os.path.join(here, name), top)
            if _left_alone(top, rel, fmt):
                return os.path.join(here, name)
    return None


def left_for_people(
    layout: Layout, recorded: Mapping[str, tuple[int, int]] | None = None
) -> list[str]:
    """`.trash/<entry>: left for a person: …` for each entry deletion cannot finish."""
    return [
        f".trash/{t.name}: {t.left_for_a_person}"
        for t in describe_trash(layout, recorded)
        if t.left_for_a_person
    ]


def describe_trash(
    layout: Layout, recorded: Mapping[str, tuple[int, int]] | None = None
) -> list[TrashEntry]:
    """What .trash/ holds, scanned without following symlinks; an unsafe .trash/ itself is
    one entry named "" with its problem. An entry in `recorded` (what its purge recorded, less
    what drains deleted: cachemgr.state.trash_sql) is not walked (a /v1/status walked 9M
    files): its foreign names are found once the drain that ends its count is done."""
    out = []
    try:
        names = list_trash(layout)
    except UnsafePathError as e:
        return [TrashEntry("", "", 0, 0, str(e))]
    for name in names:
        ns = name.partition(".")[0]
        try:
            if recorded and name in recorded:
                out.append(TrashEntry(name, ns, *recorded_count(layout, name, recorded)))
                continue
            scanned = scan_entry(layout, name)
        except UnsafePathError as e:
            out.append(TrashEntry(name, ns, 0, 0, str(e)))
            continue
        except FileNotFoundError:
            continue  # drained since it was listed
        if scanned is not None:
            usage, example = scanned
            out.append(TrashEntry(name, ns, usage.pages, usage.bytes, None, usage.other, example))
    return out


def recorded_count(
    layout: Layout, entry: str, recorded: Mapping[str, tuple[int, int]]
) -> tuple[int, int]:
    """`recorded[entry]` (files, bytes), once the entry is found a dir of its own:
    FileNotFoundError if it is gone, UnsafePathError if a link is in its place."""
    with open_dir(layout.root, f".trash/{entry}"):
        return recorded[entry]


@dataclass(frozen=True)
class DrainProgress:
    """Where a trash deletion is: totals so far across entries, and the names counted up front."""

    entry: str
    files: int
    bytes: int
    total_files: int


def drain_trash(
    layout: Layout,
    store: Store,
    *,
    actor: Actor = "auto",
    pacer: Pacer | None = None,
    progress: Callable[[DrainProgress], None] | None = None,
    dry_run: bool = False,
    locked: Callable[[str], None] = unheeded,
) -> DeleteReport:
    """Delete every purged namespace in .trash/ through deletion.py; safe to run concurrently.

    An entry that is a symlink, or holds files that are not SGLang's, stays and is reported in
    `refused`; the others are deleted and audited as `delete-trash`. A drain that finds the
    state DB write-locked by another for longer than a write's wait stops (`stopped`), once
    `locked` is told who holds it; what it deleted is recorded once the lock is free, and the
    entries after it wait for the next drain.
    """
    try:
        entries = list_trash(layout)
    except UnsafePathError as e:
        return DeleteReport(refused=(str(e),), dry_run=dry_run)
    recorded = trash_counts(layout, store.conn)
    totals = {e: recorded[e][0] if e in recorded else _count_names(layout, e) for e in entries}
    total = sum(totals.values())
    report = DeleteReport(dry_run=dry_run)
    run = RunContext(layout, store, actor=actor, dry_run=dry_run, pacer=pacer, locked=locked)
    for entry in entries:
        part = drain_entry(run, entry, progress=_ticker(progress, entry, report, total))
        report += part
        if part.stopped:  # the DB locked (no other stop here): the rest waits for the lock
            break
    return report


def drain_entry(
    run: RunContext,
    entry: str,
    *,
    progress: Callable[[int, int], None] | None = None,
    min_age: float = 0.0,
    audit_as: tuple[str, str] | None = ("delete-trash", "trash"),
) -> DeleteReport:
    """Delete one trash entry (purge and GC both go through here) and audit it.

    `audit_as` is the (action, reason) of the one audit row, None for none: GC dropping an
    unbound namespace audited its eviction when it renamed the dir here. Files younger than
    `min_age` stay (GC's drops pass its min_age; a purge's drain deletes everything).
    """
    dry_run = run.dry_run
    if not dry_run:  # the purge that moved it here was killed before it recorded so
        settle_entry(run.layout, run.store, entry)
    counted = not dry_run and audit_as is not None  # (GC's drops record no count)
    count = _CountDown(run, entry, progress) if counted else None
    try:
        part = delete_dir(
            run.layout.root,
            f".trash/{entry}",
            dry_run=dry_run,
            min_age=min_age,
            fmt=trash_format(run.layout, entry),
            # per part, as GC's own chunks: a leader that lost its lease stops mid-entry,
            # and so does a drain whose count found the DB locked
            listeners=Listeners(
                run.pacer, count or progress, stop=count.stop if count else run.stop
            ),
        )
    except BaseException as e:
        if count is not None:  # what went before the error or interrupt
            with suppress(StateLocked):
                count.take(patience=COUNT_PATIENCE)
        if isinstance(e, UnsafePathError):
            return DeleteReport(refused=(f".trash/{entry}: {e}",), dry_run=dry_run)
        if isinstance(e, FileNotFoundError):
            return DeleteReport(dry_run=dry_run)  # another drain finished it (and its count)
        raise
    if count is not None and audit_as is not None:
        _record_deleted(run, entry, part, count, audit_as)
    return part


COUNT_EVERY = 1.0  # s: what a drain deleted is taken off its entry's count this often
COUNT_PATIENCE = 1.0  # s: a tick waits this long for the DB's write lock, then leaves it


class _CountDown:
    """Takes what a drain deletes off its entry's recorded count as it goes (progress's
    running totals, a second at a time), not only at its end: a drain killed hours into an
    entry left the whole count, and GC's free-space floor then counted files long gone as
    still to be freed.

    A tick that finds the DB locked asks whether the lock goes within a write's wait
    (RunContext.recordable, which tells `locked` who holds it if not); if not, the drain
    stops at its next part. It went on to the end of the entry, millions of files at the
    drain's pace, none of them in the audit or the count until the lock went."""

    def __init__(self, run: RunContext, entry: str, progress: Callable[[int, int], None] | None):
        self.run, self.entry, self.progress = run, entry, progress
        self.seen = self.taken = (0, 0)
        self.at = time.monotonic()
        self.locked = False

    def __call__(self, files: int, size: int) -> None:
        self.seen = (files, size)
        if self.progress is not None:
            self.progress(files, size)
        if time.monotonic() - self.at >= COUNT_EVERY:
            try:
                self.take(patience=COUNT_PATIENCE)
            except StateLocked:
                self.locked = self.locked or not self.run.recordable()

    def stop(self) -> bool:
        """Whether the drain ends at this part: its run's stop, or the DB locked."""
        return self.locked or self.run.stop()

    def take(self, *, patience: float) -> None:
        """The count less what went since the last take; StateLocked if the write lock
        was not free within `patience` seconds (the next take counts it)."""
        files, size = self.seen[0] - self.taken[0], self.seen[1] - self.taken[1]
        self.at = time.monotonic()
        if files or size:
            store = self.run.store
            with store.transaction(patience=patience):
                trash_sql.drained(store.conn, self.entry, files, size)
                self.taken = self.seen

    def rest(self, part: DeleteReport) -> tuple[int, int]:
        """What `part` deleted that no tick took yet."""
        return part.files - self.taken[0], part.bytes - self.taken[1]


def _ticker(
    progress: Callable[[DrainProgress], None] | None, entry: str, done: DeleteReport, total: int
) -> Callable[[int, int], None] | None:
    """Turn delete_dir's per-entry counts into totals across the whole drain."""
    if progress is None:
        return None
    report = progress
    return lambda files, size: report(
        DrainProgress(entry, done.files + files, done.bytes + size, total)
    )


def _record_deleted(
    run: RunContext, entry: str, part: DeleteReport, count: _CountDown, audit_as: tuple[str, str]
) -> None:
    """The audit row, and the entry's count less what `part` deleted (forgotten once its
    drain is done: what it left, foreign names, a scan counts and names). A drain that deleted
    nothing and left the entry (foreign files, for a person) writes no row: the daemon's GC
    tries such an entry every run, and wrote a row of 0 pages each time. The files are gone:
    the row waits out a foreign write lock however long it is held, once `run.locked` is told
    who holds it (a `POST /v1/gc` waiting for the run answers then, not once it is free)."""
    run.record_deleted(
        lambda patience: _write_deleted(run, entry, part, count, audit_as, patience=patience)
    )


def _write_deleted(
    run: RunContext,
    entry: str,
    part: DeleteReport,
    count: _CountDown,
    audit_as: tuple[str, str],
    *,
    patience: float | None,
) -> None:
    """_record_deleted's transaction, waiting `patience` seconds for the write lock."""
    store = run.store
    m = TRASH_RE.fullmatch(entry)
    left = bool(part.stopped or part.young or part.refused)
    with store.transaction(patience=patience):
        if part.stopped or part.young:
            trash_sql.drained(store.conn, entry, *count.rest(part))
        else:
            trash_sql.forget(store.conn, entry)
        if left and not part.files:
            return
        store.audit(
            audit_as[0],
            namespace_id=m["ns"] if m else None,
            reason=audit_as[1],
            actor=run.actor,
            pages=part.files,
            bytes_=part.bytes,
        )


def trash_format(layout: Layout, entry: str) -> FileFormat:
    """The file format of a trash entry (its manifest may be gone: cachemgr.fs.tree.format_in)."""
    try:
        with open_dir(layout.root, f".trash/{entry}") as fd:
            return format_in(fd)
    except (OSError, UnsafePathError):
        return DEFAULT_FORMAT  # gone, or a link: whatever reads it next refuses it


def _count_names(layout: Layout, entry: str) -> int:
    """How many names a trash entry holds (read, not kept: ~1M names/s), for a progress total."""
    try:
        with open_dir(layout.root, f".trash/{entry}") as fd, os.scandir(fd) as names:
            return sum(1 for _ in names)
    except (OSError, UnsafePathError):
        return 0
