"""A purge's audit row, recorded before its rename, so that a kill between the two loses none.

A purge renames ns/<id> into .trash/ (outside the DB), then commits the rows that say so, the
`purge` audit row among them. Killed (kill -9, OOM) between the two, it left a trash entry that
a drain deleted later, and no row saying a purge had happened. So a purge commits its intent
first: the entry's name, the dir's (dev, ino), the audit row's fields. Whoever deletes the
intent writes the audit row, in one transaction, so it is written once: the purge's own
transaction; a drain about to delete the entry (GC's, at the daemon's start too, or a purge's)
that finds the intent's dir there; the next purge, under the root lock, which writes it if
the dir left ns/<id>, and else drops the intent (killed before the rename: nothing happened).

GC's drop of an unbound namespace (cachemgr.gc.drop) moves the dir the same way and records
its intent the same way; its row is an `evict` audit row (Intent.action).
"""

from __future__ import annotations

import logging
import sqlite3

from cachemgr.fs.deletecheck import dir_at
from cachemgr.layout import Layout
from cachemgr.state import intents_sql, trash_sql
from cachemgr.state.intents_sql import Intent
from cachemgr.state.store import Store

log = logging.getLogger(__name__)
SWAPPED = "n"  # a recreated namespace's old dir gets its trash name + this (purge._empty_dir)


def record(store: Store, intent: Intent) -> None:
    """Commit `intent` inside the purge's transaction, which goes on (before the rename)."""
    intents_sql.insert(store.conn, intent)
    store.commit_and_begin()


def audit_once(store: Store, intent: Intent) -> bool:
    """Delete the intent and write its audit row, unless another connection did it
    first (then False). Call inside a transaction."""
    if not intents_sql.delete(store.conn, intent.entry):
        return False
    audit(store, intent)
    return True


def audit(store: Store, intent: Intent) -> None:
    """Write the audit row `intent` stands for. Call inside a transaction."""
    store.audit(
        intent.action,
        namespace_id=intent.namespace_id,
        reason=intent.reason,
        actor=intent.actor,
        pages=intent.pages,
        bytes_=intent.bytes,
        at=intent.at,
    )


def settle_entry(layout: Layout, store: Store, entry: str) -> None:
    """Before .trash/<entry> is deleted: write the audit row of the purge that moved it there
    if that purge never committed. Only if the entry is the intent's dir: a purge killed
    after it made its empty successor but before the swap left that one under the name."""
    for intent in intents_sql.pending(store.conn, entry.removesuffix(SWAPPED)):
        if dir_at(layout.root, f".trash/{entry}") == (intent.dev, intent.ino):
            with store.transaction(patience=float("inf")):  # the entry is about to go
                if audit_once(store, intent):
                    _audited_late(intent, entry)


def settle_all(layout: Layout, store: Store) -> None:
    """Under the root lock (no purge between its intent and its rename): each intent of a purge
    killed before its commit gets its audit row if its dir left ns/<id>, else is dropped."""
    for intent in intents_sql.pending(store.conn):
        moved = dir_at(layout.root, f"ns/{intent.namespace_id}") != (intent.dev, intent.ino)
        with store.transaction():
            if not moved:
                intents_sql.delete(store.conn, intent.entry)
            elif audit_once(store, intent):
                _audited_late(intent, intent.entry)


def trash_counts(layout: Layout, conn: sqlite3.Connection) -> dict[str, tuple[int, int]]:
    """Each .trash/ entry's (files, bytes) left as recorded (trash_sql.recorded), and for one a
    purge or GC drop has renamed but not counted yet, its intent's: the purge commits its
    count after the rename, with the namespace's rows dropped (~1 s at 10M pages), and a plan
    read in that window walked the entry (a walk of 10M pages takes 150 s: in a 10M run a
    drain began 127 s after the purge, where it begins at once). Only where the entry is the
    intent's dir, as `settle_entry` asks; not in a fleet, whose purges record no count; not a
    count of 0, which a purge never records (a walk says what is there)."""
    counts = trash_sql.recorded(conn)
    if layout.node is not None:
        return counts
    for intent in intents_sql.pending(conn):
        for entry in (intent.entry, f"{intent.entry}{SWAPPED}"):
            here = entry not in counts and intent.pages
            if here and dir_at(layout.root, f".trash/{entry}") == (intent.dev, intent.ino):
                counts[entry] = (intent.pages, intent.bytes)
    return counts


def dir_id(layout: Layout, ns_id: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of ns/<id>, None if it is no dir (nothing to rename)."""
    return dir_at(layout.root, f"ns/{ns_id}")


def _audited_late(intent: Intent, entry: str) -> None:
    log.warning(
        "a purge or GC drop was killed after it moved a namespace and before it recorded "
        "that; its audit row is written now",
        extra={
            "namespace": intent.namespace_id,
            "entry": entry,
            "actor": intent.actor,
            "action": intent.action,
        },
    )
