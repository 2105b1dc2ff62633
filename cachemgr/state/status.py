"""Status reads of the state DB's small tables (bindings, audit) and of the root's filesystem;
never the pages table, so they stay cheap with millions of pages. Per-namespace status, which
also reads manifests, is cachemgr.ns.status.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass, field


def bindings_by_namespace(conn: sqlite3.Connection) -> dict[str, tuple[str, ...]]:
    """namespace id → the instances bound to it, sorted."""
    out: dict[str, list[str]] = {}
    for inst, ns in conn.execute("SELECT instance, namespace_id FROM bindings ORDER BY instance"):
        out.setdefault(str(ns), []).append(str(inst))
    return {ns: tuple(v) for ns, v in out.items()}


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
