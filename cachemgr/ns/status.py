"""Per-namespace status from the state DB, the manifests and the names under <root>/ns (and
the daemon's live counters when it runs).

It reads small tables (namespace_stats, namespaces, bindings) and never the pages table, so it
stays cheap with millions of pages.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, computed_field

from cachemgr.errors import StateError
from cachemgr.formats import DEFAULT_ENGINE, FORMATS, EngineName, engine_of
from cachemgr.fs.dirlimit import DirIndex, page_name_len
from cachemgr.layout import Layout
from cachemgr.ns import registry as nsreg
from cachemgr.ns.bindings import bound_now
from cachemgr.ns.manifest import (
    identity_kv_cache_dtype,
    identity_model,
    identity_page_size,
    identity_record,
    read_manifest,
)
from cachemgr.state import pages_sql, registry_sql
from cachemgr.state.index import namespace_dirs


class LiveCounts(Protocol):
    reads: int
    writes: int


class NamespaceStatus(BaseModel):
    """One namespace: its pages on disk, how often they were read and stored, its identity."""

    model_config = ConfigDict(frozen=True)

    id: str
    # active (a DB row, or a manifest no row is behind yet: another node's init) | purged |
    # unregistered (a dir with neither), or, left alone
    # by every command: bad-manifest | unsafe (ns/<id> is not a real dir) | unreadable (this
    # user may not read its dir or manifest)
    state: str
    problem: str | None = None  # why a bad-manifest, unsafe or unreadable one is left alone
    has_dir: bool
    # The counts of its dir (pages, their files, bytes, temp, foreign and corrupt files):
    # null when it could not be read (state unreadable) or is not a real dir (unsafe), never
    # a 0 that was not counted. A page is one file but for SGLang at TP > 1 (a file a rank)
    pages: int | None
    files: int | None = None
    # bytes of the longest page file name its dir has held (0: none yet): a flat dir's entry
    # limit is computed for its names' length
    longest_name: int = 0
    bytes: int | None
    page_reads: int  # lifetime, as observed by the watcher
    page_writes: int
    reads_since_start: int | None = None  # None when no daemon is running
    writes_since_start: int | None = None
    last_read_at: float | None = None
    last_write_at: float | None = None
    temp_files: int | None = 0
    foreign_files: int | None = 0
    corrupt_files: int | None = 0
    scanned_at: float | None = None
    instances: tuple[str, ...] = ()
    engine: EngineName = DEFAULT_ENGINE  # which engine's cache it is (its identity record says)
    model: str | None = None
    kv_cache_dtype: str | None = None
    page_size: int | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def hit_ratio(self) -> float | None:
        """Page reads / (reads + writes), lifetime; None before any activity."""
        total = self.page_reads + self.page_writes
        return self.page_reads / total if total else None

    @property
    def dir_entries(self) -> int | None:
        """Entries of its dir, at the last scan: page files, temps and foreign files; None
        when it was not counted."""
        counts = (self.files, self.temp_files, self.foreign_files)
        return None if None in counts else sum(c for c in counts if c is not None)

    def entry_limit(self, index: DirIndex | None) -> int | None:
        """Entries its dir takes before ENOSPC on a filesystem `index` describes, if its
        format keeps the pages in the dir itself; None where no limit is known."""
        if index is None or FORMATS[self.engine].nesting is not None:
            return None
        return index.limit(max(page_name_len(self.model), self.longest_name))

    def uncounted(self, state: str, problem: str) -> NamespaceStatus:
        """This status for a dir whose pages could not be counted now: `state` and why, its
        counts null (the index's last ones may be stale, and 0 would be a count not taken)."""
        return self.model_copy(update={"state": state, "problem": problem, **UNCOUNTED})


# What a status whose dir was not counted says of its counts.
UNCOUNTED = dict.fromkeys(
    ("pages", "files", "bytes", "temp_files", "foreign_files", "corrupt_files")
)


def _manifest_identity(layout: Layout, ns_id: str) -> dict[str, Any] | None:
    """The identity in its manifest; None without a manifest that can be read."""
    try:
        manifest = read_manifest(layout, ns_id)
    except StateError:
        return None  # reported as the namespace's state
    return manifest.identity if manifest is not None else None


def namespace_statuses(
    conn: sqlite3.Connection,
    layout: Layout,
    live: Mapping[str, LiveCounts] | None = None,
) -> list[NamespaceStatus]:
    """Every namespace with a dir, pages in the index, or an active registry row; one whose
    dir this process may not list is `unreadable`, its counts null."""
    stats = {r["namespace_id"]: r for r in pages_sql.namespace_stats_rows(conn)}
    registry = {r["id"]: r for r in registry_sql.registry_rows(conn)}
    bindings = bound_now(layout, conn)
    dirs = set(namespace_dirs(layout))
    damaged = nsreg.damaged(layout)
    ids = dirs | set(damaged) | {ns for ns, r in stats.items() if r["pages"] > 0}
    ids |= {ns for ns, r in registry.items() if r["state"] != "purged"} | set(bindings)
    out = []
    for ns in sorted(ids):
        s, reg = stats.get(ns), registry.get(ns)
        if reg is not None:
            ident, registered = identity_record(reg["identity_json"]), reg["state"]
        else:  # registered as the next read of the disk would (a daemon's is a reconcile away)
            manifest = _manifest_identity(layout, ns)
            ident, registered = manifest or {}, "unregistered" if manifest is None else "active"
        counts = live.get(ns) if live is not None else None
        state, problem = damaged.get(ns, (registered, None))
        status = NamespaceStatus(
            id=ns,
            state=state,
            problem=problem,
            has_dir=ns in dirs,
            pages=_get(s, "pages"),
            files=_get(s, "files"),
            longest_name=_get(s, "name_len"),
            bytes=_get(s, "bytes"),
            page_reads=_get(s, "page_reads"),
            page_writes=_get(s, "page_writes"),
            reads_since_start=None if live is None else (counts.reads if counts else 0),
            writes_since_start=None if live is None else (counts.writes if counts else 0),
            last_read_at=s["last_read_at"] if s else None,
            last_write_at=s["last_write_at"] if s else None,
            temp_files=_get(s, "temp_files"),
            foreign_files=_get(s, "foreign_files"),
            corrupt_files=_get(s, "corrupt_files"),
            scanned_at=s["scanned_at"] if s else None,
            instances=bindings.get(ns, ()),
            engine=engine_of(ident),
            model=identity_model(ident),
            kv_cache_dtype=identity_kv_cache_dtype(ident),
            page_size=identity_page_size(ident),
        )
        if state == "unsafe":  # not a real dir: cachemgr does not enter it
            status = status.model_copy(update=UNCOUNTED)
        elif ns in dirs and (why := nsreg.unreadable_dir(layout, ns)) is not None:
            status = status.uncounted("unreadable", why)
        out.append(status)
    return out


def _get(row: sqlite3.Row | None, key: str) -> int:
    return int(row[key]) if row is not None and row[key] is not None else 0
