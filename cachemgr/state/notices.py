"""Notices said once per root: the state DB remembers which ones this root has heard."""

from __future__ import annotations

from cachemgr.state.store import Store


def first_time(store: Store, key: str, now: float) -> bool:
    """Record the notice `key`; True when this root had not heard it before."""
    with store.transaction() as conn:
        cur = conn.execute("INSERT OR IGNORE INTO notices (key, at) VALUES (?, ?)", (key, now))
        return cur.rowcount == 1
