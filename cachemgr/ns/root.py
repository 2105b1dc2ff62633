"""Opening a cache root for a command: created (init, exec, serve) or found, never both.

Read-only commands use `existing_layout` and `reading_store`: a mistyped root is a one-line
error, and on a real root they leave the files as they found them.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cachemgr.errors import ConfigError, NotFoundError
from cachemgr.formats import FORMATS
from cachemgr.fs.dirscan import scan_usage
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.ns.purge_intent import trash_counts
from cachemgr.ns.quarantine import is_denied, unreadable_problem
from cachemgr.ns.registry import adopt_from_disk
from cachemgr.ns.status import NamespaceStatus, namespace_statuses
from cachemgr.ns.trash import left_for_people
from cachemgr.settings import Settings
from cachemgr.state.dbfile import unavailable
from cachemgr.state.snapshot import snapshot
from cachemgr.state.store import Store


def fleet_node(settings: Settings) -> str | None:
    """This node's name in a fleet (`node_name`, else the hostname); None outside one."""
    if settings.fleet_coordinator is None:
        return None
    return settings.node_name or socket.gethostname()


def settings_layout(settings: Settings) -> Layout:
    """The layout the settings describe, this node's fleet name in it."""
    return Layout.at(settings.root, settings.state_dir, node=fleet_node(settings))


def created_layout(settings: Settings) -> Layout:
    """The root's layout, its skeleton created (init, exec, serve)."""
    layout = settings_layout(settings)
    refuse_file_root(layout)
    create_root(layout)
    return layout


def existing_layout(settings: Settings) -> Layout:
    """The root's layout; the root must exist (nothing is created for a mistyped path)."""
    layout = settings_layout(settings)
    refuse_file_root(layout)
    if not layout.root.is_dir():
        raise NotFoundError(f"no cache root at {layout.root} (init or serve creates it)")
    return layout


def refuse_file_root(layout: Layout) -> None:
    """A root that exists but is not a directory is a config mistake (exit 2), not an empty root."""
    if layout.root.exists() and not layout.root.is_dir():
        raise ConfigError(f"cache root {layout.root} is not a directory")


@contextmanager
def opened_store(layout: Layout) -> Iterator[Store]:
    """The state DB, with namespaces found on disk but unknown to it registered."""
    with Store.open(layout.db_path) as store:
        if layout.ns_root.is_dir():
            adopt_from_disk(layout, store)
        yield store


def has_state(layout: Layout) -> bool:
    """Whether there is anything to read: a DB, or namespace dirs a lost DB can learn."""
    return layout.ns_root.is_dir() or layout.db_path.exists()  # a DB may be out of reach


def status_from_disk(layout: Layout) -> dict[str, Any]:
    """The /v1/status report without a daemon: pages and bytes counted on disk, history
    from the DB (a lost DB, or one moved aside as corrupt, learns the namespaces from disk)."""
    statuses: list[NamespaceStatus] = []
    missing = None
    recorded: dict[str, tuple[int, int]] = {}
    if has_state(layout):
        with reading_what_it_can(layout, page_rows=False) as (store, missing):
            statuses = namespace_statuses(store.conn, layout)
            recorded = trash_counts(layout, store.conn)
    return {
        "root": str(layout.root),
        "source": "disk",
        "namespaces": [_counted(layout, s).model_dump(mode="json") for s in statuses],
        "left_for_a_person": left_for_people(layout, recorded),
        "state_dir_problem": missing,
    }


def _counted(layout: Layout, status: NamespaceStatus) -> NamespaceStatus:
    """`status` with its pages, bytes, temp, foreign and torn files counted on disk (all of
    them: a count left from the DB's last scan beside fresh ones said a torn page GC had since
    deleted and missed a foreign file put there since); a dir this user may not read (another
    user's 0700, chmod 000) is said as its state, its counts null, and the others are still
    counted."""
    if not status.has_dir or status.pages is None:  # none, or found uncountable already
        return status
    try:
        m = scan_usage(layout, f"ns/{status.id}", FORMATS[status.engine])
    except OSError as e:  # made unreadable since it was found readable
        if not is_denied(e):
            raise
        return status.uncounted("unreadable", unreadable_problem(e))
    if m is None:
        return status
    counts = {"pages": m.pages, "files": m.files, "bytes": m.bytes, "temp_files": m.temps}
    counts |= {"foreign_files": m.other, "corrupt_files": m.corrupt}
    return status.model_copy(update=counts)


@contextmanager
def reading_what_it_can(
    layout: Layout, *, page_rows: bool = True
) -> Iterator[tuple[Store, str | None]]:
    """`reading_store`; or, when this user may not use the state dir, an empty copy that
    learns the namespaces and bindings from disk as after a lost DB, and a line saying what
    is missing. For `ls` and `status`: the pages are there without the DB (GC and purge need
    it, and refuse)."""
    problem = unavailable(layout.state_dir, layout.db_path)
    if problem is None:
        with reading_store(layout, page_rows=page_rows) as store:
            yield store, None
        return
    with snapshot(Path(":memory:")) as store:
        if layout.ns_root.is_dir():
            adopt_from_disk(layout, store, write_files=False)
        yield store, f"{problem}; shown from disk alone (no history, reads or writes)"


@contextmanager
def reading_store(layout: Layout, *, page_rows: bool = True) -> Iterator[Store]:
    """What read-only commands read: a copy of the state DB (cachemgr.state.snapshot) with
    the namespaces found on disk registered in it; nothing under the root is written. A
    command that reads no page rows says so (`page_rows=False`): its copy has none."""
    with snapshot(layout.db_path, page_rows=page_rows) as store:
        if layout.ns_root.is_dir():
            adopt_from_disk(layout, store, write_files=False)
        yield store
