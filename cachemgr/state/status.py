"""Per-namespace status from the state DB (and the daemon's live counters when it runs).

Everything here reads small tables (namespace_stats, namespaces, bindings, audit) and the
names under <root>/ns, never the pages table, so it stays cheap with millions of pages.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, computed_field

from cachemgr.errors import StateError
from cachemgr.layout import Layout
from cachemgr.ns import registry as nsreg
from cachemgr.ns.manifest import read_manifest
from cachemgr.state.index import namespace_dirs


class LiveCounts(Protocol):
    reads: int
    writes: int


class NamespaceStatus(BaseModel):
    """One namespace: its pages on disk, how often they were read and stored, its identity."""

    model_config = ConfigDict(frozen=True)

    id: str
    # active | purging | purged | unregistered (a dir without a manifest row), or, left alone
    # by every command: bad-manifest | unsafe (ns/<id> is not a real dir)
    state: str
    problem: str | None = None  # why a bad-manifest or unsafe namespace is left alone
    has_dir: bool
    pages: int
    bytes: int
    page_reads: int  # lifetime, as observed by the watcher
    page_writes: int
    reads_since_start: int | None = None  # None when no daemon is running
    writes_since_start: int | None = None
    last_read_at: float | None = None
    last_write_at: float | None = None
    temp_files: int = 0
    foreign_files: int = 0
    corrupt_files: int = 0
    scanned_at: float | None = None
    instances: tuple[str, ...] = ()
    model: str | None = None
    kv_cache_dtype: str | None = None
    page_size: int | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def hit_ratio(self) -> float | None:
        """Page reads / (reads + writes), lifetime; None before any activity."""
        total = self.page_reads + self.page_writes
        return self.page_reads / total if total else None


def identity_summary(identity_json: str | None) -> tuple[str | None, str | None, int | None]:
    """(model, kv dtype, page size) from an identity record; Nones for what it lacks."""
    try:
        record = json.loads(identity_json) if identity_json else {}
    except (ValueError, RecursionError):
        return None, None, None
    if not isinstance(record, dict):
        return None, None, None
    record = record.get("identity", record)
    source = record.get("source") if isinstance(record.get("source"), dict) else {}
    model = source.get("served_model_name") or source.get("model_path") or record.get("model")
    dtype, page = record.get("kv_cache_dtype"), record.get("page_size")
    return (
        str(model) if model else None,
        str(dtype) if dtype else None,
        page if type(page) is int else None,
    )


def _manifest_identity(layout: Layout, ns_id: str) -> str | None:
    try:
        manifest = read_manifest(layout, ns_id)
    except StateError:
        return None  # reported as the namespace's state
    return json.dumps(manifest.identity) if manifest is not None else None


def namespace_statuses(
    conn: sqlite3.Connection,
    layout: Layout,
    live: Mapping[str, LiveCounts] | None = None,
) -> list[NamespaceStatus]:
    """Every namespace with a dir, pages in the index, or an active registry row."""
    stats = {r["namespace_id"]: r for r in conn.execute("SELECT * FROM namespace_stats")}
    registry = {r["id"]: r for r in conn.execute("SELECT id, state, identity_json FROM namespaces")}
    bindings: dict[str, list[str]] = {}
    for inst, ns in conn.execute("SELECT instance, namespace_id FROM bindings ORDER BY instance"):
        bindings.setdefault(ns, []).append(inst)
    dirs = set(namespace_dirs(layout))
    damaged = nsreg.damaged(layout)
    ids = dirs | set(damaged) | {ns for ns, r in stats.items() if r["pages"] > 0}
    ids |= {ns for ns, r in registry.items() if r["state"] != "purged"} | set(bindings)
    out = []
    for ns in sorted(ids):
        s, reg = stats.get(ns), registry.get(ns)
        ident = reg["identity_json"] if reg is not None else _manifest_identity(layout, ns)
        model, dtype, page_size = identity_summary(ident)
        counts = live.get(ns) if live is not None else None
        registered = reg["state"] if reg is not None else "unregistered"
        state, problem = damaged.get(ns, (registered, None))
        out.append(
            NamespaceStatus(
                id=ns,
                state=state,
                problem=problem,
                has_dir=ns in dirs,
                pages=_get(s, "pages"),
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
                instances=tuple(bindings.get(ns, ())),
                model=model,
                kv_cache_dtype=dtype,
                page_size=page_size,
            )
        )
    return out


def _get(row: sqlite3.Row | None, key: str) -> int:
    return int(row[key]) if row is not None and row[key] is not None else 0


@dataclass(frozen=True)
class AuditTotal:
    """Sum of one (action, reason) in the audit log."""

    count: int = 0
    pages: int = 0
    bytes: int = 0


@dataclass
class AuditTotals:
    """Audit log sums, read incrementally (only rows newer than the last read)."""

    last_id: int = 0
    totals: dict[tuple[str, str], AuditTotal] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def refresh(self, conn: sqlite3.Connection) -> dict[tuple[str, str], AuditTotal]:
        with self._lock:
            if conn.execute("SELECT coalesce(max(id), 0) FROM audit").fetchone()[0] < self.last_id:
                self.last_id = 0  # a DB rebuilt from disk: its ids start over, the totals go on
            rows = conn.execute(
                "SELECT max(id), action, reason, count(*), sum(pages), sum(bytes) FROM audit"
                " WHERE id > ? GROUP BY action, reason",
                (self.last_id,),
            ).fetchall()
            for top, action, reason, n, pages, size in rows:
                old = self.totals.get((action, reason), AuditTotal())
                self.totals[(action, reason)] = AuditTotal(
                    old.count + n, old.pages + (pages or 0), old.bytes + (size or 0)
                )
                self.last_id = max(self.last_id, int(top))
            return dict(self.totals)


def as_jsonable(statuses: list[NamespaceStatus]) -> list[dict[str, Any]]:
    return [s.model_dump(mode="json") for s in statuses]
