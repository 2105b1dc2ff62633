"""Doctor's root checks when the state dir may be one this user cannot use.

A state dir made unreadable (a chmod, another user's volume) stopped `doctor` at its first
read of the DB with one error line, and nothing else was checked. It is a finding with its
fix, and the checks that need no DB still run.
"""

from __future__ import annotations

import os

from cachemgr.doctor.dirindex import entries_now, lint_dir_entries
from cachemgr.doctor.finding import Finding
from cachemgr.doctor.root import lint_root
from cachemgr.errors import StateUnavailable
from cachemgr.fs.dirlimit import dir_index as read_dir_index
from cachemgr.layout import Layout
from cachemgr.ns.quarantine import ns_root_problem
from cachemgr.ns.root import reading_store
from cachemgr.ns.status import namespace_statuses
from cachemgr.state.dbfile import denied_as_unavailable


def lint_root_and_state(layout: Layout, *, indexed: bool) -> list[Finding]:
    """`lint_root` and the flat dirs' entry counts over a copy of the state DB (`indexed`: a
    daemon keeps its counts; otherwise a limited dir's are counted on disk); or a
    `state-unreadable` finding and the checks that need no DB."""
    if ns_root_problem(layout) is not None:  # (gone, a symlink: a read of the DB adopts from
        return lint_root(layout, None)  # ns/ and stopped doctor at one error line)
    try:
        with (
            denied_as_unavailable(layout.state_dir),
            reading_store(layout, page_rows=False) as store,
        ):
            findings = lint_root(layout, store)
            statuses = namespace_statuses(store.conn, layout)
    except StateUnavailable as e:
        return [_unreadable(layout, e), *lint_root(layout, None)]
    index = read_dir_index(layout.root)
    if not indexed:
        statuses = [entries_now(layout, s, index) for s in statuses]
    return findings + lint_dir_entries(statuses, index)


def _unreadable(layout: Layout, error: StateUnavailable) -> Finding:
    cause = error.__cause__
    why = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(error)
    uid = os.geteuid()
    what = (
        f"state dir {layout.state_dir} cannot be used by this user (uid {uid}): {why}; the "
        "daemon cannot index or GC, and doctor could not check the namespaces' states"
    )
    fix = f"chmod u+rwx {layout.state_dir} (or chown it to uid {uid}), as its owner"
    return Finding("error", "state-unreadable", what, fix)
