"""Opening a cache root for a command: created (init, exec, serve) or found, never both.

Read-only commands use `existing_layout` and `reading_store`: a mistyped root is a one-line
error, and on a real root they leave the files as they found them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from cachemgr.engines import FORMATS
from cachemgr.errors import ConfigError, NotFoundError
from cachemgr.fs.dirscan import scan_usage
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.ns.registry import adopt_from_disk
from cachemgr.ns.status import NamespaceStatus, namespace_statuses
from cachemgr.ns.trash import left_for_people
from cachemgr.settings import Settings
from cachemgr.state.snapshot import snapshot
from cachemgr.state.store import Store


def created_layout(settings: Settings) -> Layout:
    """The root's layout, its skeleton created (init, exec, serve)."""
    layout = Layout.at(settings.root, settings.state_dir)
    refuse_file_root(layout)
    create_root(layout)
    return layout


def existing_layout(settings: Settings) -> Layout:
    """The root's layout; the root must exist (nothing is created for a mistyped path)."""
    layout = Layout.at(settings.root, settings.state_dir)
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
    return layout.db_path.exists() or layout.ns_root.is_dir()


def status_from_disk(layout: Layout) -> dict[str, Any]:
    """The /v1/status report without a daemon: pages and bytes counted on disk, history
    from the DB (a lost DB, or one moved aside as corrupt, learns the namespaces from disk)."""
    statuses: list[NamespaceStatus] = []
    if has_state(layout):
        with reading_store(layout) as store:
            statuses = namespace_statuses(store.conn, layout)
    out = []
    for s in statuses:
        if s.has_dir:
            m = scan_usage(layout, f"ns/{s.id}", FORMATS[s.engine])
            if m is not None:
                s = s.model_copy(update={"pages": m.pages, "bytes": m.bytes, "temp_files": m.temps})
        out.append(s.model_dump(mode="json"))
    return {"root": str(layout.root), "source": "disk", "namespaces": out,
            "left_for_a_person": left_for_people(layout)}  # fmt: skip


@contextmanager
def reading_store(layout: Layout) -> Iterator[Store]:
    """What read-only commands read: a copy of the state DB (cachemgr.state.snapshot) with
    the namespaces found on disk registered in it; nothing under the root is written."""
    with snapshot(layout.db_path) as store:
        if layout.ns_root.is_dir():
            adopt_from_disk(layout, store, write_files=False)
        yield store
