"""Audit rows of deletions the state DB could not take when they were made.

The free-space floor pass deletes without the DB (cachemgr.gc.floor), so it runs while the
state dir is unusable (its mode changed, its filesystem full, its write lock held elsewhere);
its audit row must not be lost with the failed write: a deletion is never left unrecorded. The
rows wait here, oldest first, and go into the audit table with the next write that succeeds.

Bounded: HELD_ROWS rows (a floor pass makes one to three, one pass every few seconds at most:
an hour of passes or more). Past it the oldest row is dropped, said at ERROR with its counts and
counted in `cachemgr_gc_audit_rows_dropped_total`; each pass was said at WARNING when it was
held. Rows still held when the process ends are said at ERROR: they end with it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from cachemgr.state.store import Store

log = logging.getLogger(__name__)
HELD_ROWS = 1024  # ~100 bytes each


@dataclass(frozen=True)
class AuditRow:
    """One row of the audit table, as Store.audit writes it (no namespace: a floor pass's
    rows are per reason, as its report's totals)."""

    action: str
    reason: str
    actor: str
    pages: int
    bytes: int
    at: float

    def write(self, store: Store) -> None:
        """Insert it (inside the caller's transaction)."""
        store.audit(
            self.action,
            namespace_id=None,
            reason=self.reason,
            actor=self.actor,
            pages=self.pages,
            bytes_=self.bytes,
            at=self.at,
        )


class HeldAudits:
    """The rows waiting for the DB; one owner (a GC runner, under its lock) at a time."""

    def __init__(self, limit: int = HELD_ROWS) -> None:
        self.limit = limit
        self._rows: deque[AuditRow] = deque()
        self.dropped = 0  # rows that overflowed the bound (a counter, for metrics)

    def __len__(self) -> int:
        return len(self._rows)

    def hold(self, rows: Iterable[AuditRow]) -> None:
        """Keep `rows` for later; the oldest held go past the bound, each said."""
        for row in rows:
            if len(self._rows) >= self.limit:
                lost = self._rows.popleft()
                self.dropped += 1
                log.error(
                    "audit row dropped: more held than the bound while the state DB took no writes",
                    extra={**asdict(lost), "bound": self.limit},
                )
            self._rows.append(row)

    def pending(self) -> tuple[AuditRow, ...]:
        """The rows held now, oldest first (write them, then call `written`)."""
        return tuple(self._rows)

    def written(self, rows: tuple[AuditRow, ...]) -> None:
        """`rows` (a `pending()` taken before) are in the audit table now: no longer held."""
        if not rows:
            return
        for _ in rows:
            self._rows.popleft()
        log.warning("held audit rows written: the state DB takes writes again", extra=_totals(rows))

    def write(self, store: Store) -> None:
        """Write every held row in one transaction; on an error they stay held."""
        rows = self.pending()
        if not rows:
            return
        with store.transaction():
            for row in rows:
                row.write(store)
        self.written(rows)

    def abandon(self) -> None:
        """The process ends: say what is still held (its deletions were said when held)."""
        if self._rows:
            log.error(
                "audit rows never written: the state DB took no writes until the end",
                extra=_totals(self.pending()),
            )
            self._rows.clear()


def _totals(rows: tuple[AuditRow, ...]) -> dict[str, int]:
    return {
        "rows": len(rows),
        "pages": sum(r.pages for r in rows),
        "bytes": sum(r.bytes for r in rows),
    }
