"""The statements on the registry's tables: namespaces (one row per namespace ever registered)
and bindings (instance → namespace). Callers own the transaction (Store.transaction); these
only run one statement each, on the connection they are given.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable

NamespaceRow = tuple[str, str, str, float, float]  # id, digest, identity_json, created, active


def namespace_ids(conn: sqlite3.Connection) -> set[str]:
    """Every registered namespace id, purged ones included."""
    return {str(r[0]) for r in conn.execute("SELECT id FROM namespaces")}


def upsert_namespace(conn: sqlite3.Connection, row: NamespaceRow) -> None:
    """Insert a namespace's row, or refresh it from its manifest; either way it is active."""
    conn.execute(
        "INSERT INTO namespaces (id, digest, identity_json, created_at, last_active_at, state)"
        " VALUES (?, ?, ?, ?, ?, 'active') ON CONFLICT(id) DO UPDATE SET"
        " digest = excluded.digest, identity_json = excluded.identity_json,"
        " last_active_at = excluded.last_active_at, state = 'active'",
        row,
    )


def mark_namespace_purged(conn: sqlite3.Connection, ns_id: str) -> None:
    """Keep a purged namespace's row (history) with state 'purged'."""
    conn.execute("UPDATE namespaces SET state = 'purged' WHERE id = ?", (ns_id,))


def identity_json(conn: sqlite3.Connection, ns_id: str) -> str | None:
    """The identity record a namespace was registered with, as stored (JSON text)."""
    found = conn.execute("SELECT identity_json FROM namespaces WHERE id = ?", (ns_id,)).fetchone()
    return None if found is None else str(found[0])


def registry_rows(conn: sqlite3.Connection) -> list[sqlite3.Row]:
    """id, state and identity_json of every registered namespace."""
    return conn.execute("SELECT id, state, identity_json FROM namespaces").fetchall()


def active_namespaces(conn: sqlite3.Connection) -> list[tuple[str, str, str]]:
    """(id, digest, identity_json) of each active namespace, by id."""
    return [
        (str(i), str(d), str(j))
        for i, d, j in conn.execute(
            "SELECT id, digest, identity_json FROM namespaces WHERE state = 'active' ORDER BY id"
        )
    ]


def upsert_binding(conn: sqlite3.Connection, instance: str, ns_id: str, at: float) -> None:
    """Bind `instance` to `ns_id`, replacing whatever it was bound to."""
    conn.execute(
        "INSERT INTO bindings (instance, namespace_id, bound_at) VALUES (?, ?, ?)"
        " ON CONFLICT(instance) DO UPDATE SET namespace_id = excluded.namespace_id,"
        " bound_at = excluded.bound_at",
        (instance, ns_id, at),
    )


def bind_if_new(conn: sqlite3.Connection, instance: str, ns_id: str, at: float) -> bool:
    """Bind `instance` unless it is bound already or `ns_id` is not registered; True if bound."""
    cur = conn.execute(
        "INSERT INTO bindings (instance, namespace_id, bound_at)"
        " SELECT ?, id, ? FROM namespaces WHERE id = ? ON CONFLICT(instance) DO NOTHING",
        (instance, at, ns_id),
    )
    return bool(cur.rowcount)


def rebind(conn: sqlite3.Connection, instance: str, ns_id: str, at: float) -> bool:
    """Bind `instance` to `ns_id`, bound or not before, if `ns_id` is registered; True if so."""
    cur = conn.execute(
        "INSERT INTO bindings (instance, namespace_id, bound_at)"
        " SELECT ?, id, ? FROM namespaces WHERE id = ? ON CONFLICT(instance) DO UPDATE SET"
        " namespace_id = excluded.namespace_id, bound_at = excluded.bound_at",
        (instance, at, ns_id),
    )
    return bool(cur.rowcount)


def binding_of(conn: sqlite3.Connection, instance: str) -> str | None:
    """The namespace `instance` is bound to, if any."""
    row = conn.execute(
        "SELECT namespace_id FROM bindings WHERE instance = ?", (instance,)
    ).fetchone()
    return None if row is None else str(row[0])


def instances_of(conn: sqlite3.Connection, ns_id: str) -> tuple[str, ...]:
    """The instances bound to `ns_id`, sorted."""
    rows = conn.execute(
        "SELECT instance FROM bindings WHERE namespace_id = ? ORDER BY instance", (ns_id,)
    ).fetchall()
    return tuple(str(r[0]) for r in rows)


def is_bound(conn: sqlite3.Connection, ns_id: str) -> bool:
    """Whether any instance is bound to `ns_id`."""
    row = conn.execute("SELECT 1 FROM bindings WHERE namespace_id = ?", (ns_id,)).fetchone()
    return row is not None


def all_bindings(conn: sqlite3.Connection) -> Iterable[tuple[str, str, float]]:
    """(instance, namespace id, bound_at) of every binding."""
    rows = conn.execute("SELECT instance, namespace_id, bound_at FROM bindings")
    return [(str(i), str(ns), float(at)) for i, ns, at in rows]


def bound_namespace(conn: sqlite3.Connection, instance: str) -> tuple[str, str, int] | None:
    """The namespace `instance` is bound to: (id, identity_json, indexed page count)."""
    row = conn.execute(
        "SELECT n.id, n.identity_json, coalesce(s.pages, 0) FROM bindings b"
        " JOIN namespaces n ON n.id = b.namespace_id"
        " LEFT JOIN namespace_stats s ON s.namespace_id = n.id WHERE b.instance = ?",
        (instance,),
    ).fetchone()
    return None if row is None else (str(row[0]), str(row[1]), int(row[2]))
