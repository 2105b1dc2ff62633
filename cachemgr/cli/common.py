"""Pieces the namespace commands share: opening the root, trash progress."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from cachemgr.errors import ConfigError, NotFoundError
from cachemgr.fs.deletion import DeleteReport, Pacer
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.ns.purge import Actor, DrainProgress, drain_trash
from cachemgr.ns.registry import adopt_from_disk
from cachemgr.settings import Settings
from cachemgr.state.store import Store

log = logging.getLogger("cachemgr.ns.purge")


def root_layout(settings: Settings, *, create: bool) -> Layout:
    """The root's layout; created if asked, else it must exist already."""
    layout = Layout.at(settings.root, settings.state_dir)
    refuse_file_root(layout)
    if create:
        create_root(layout)
    elif not layout.root.is_dir():
        raise NotFoundError(f"no cache root at {layout.root} (cachemgr init creates it)")
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


def drain_with_progress(
    layout: Layout, store: Store, *, actor: Actor, pacer: Pacer | None = None
) -> DeleteReport:
    """Delete the trash now: a progress bar on a terminal, a log line a second otherwise."""
    if sys.stderr.isatty():
        return _drain_with_bar(layout, store, actor, pacer)
    started = time.monotonic()
    report = drain_trash(layout, store, actor=actor, pacer=pacer, progress=_log_every(1.0))
    log.log(
        logging.INFO if report.files or report.refused else logging.DEBUG,
        "trash deleted",
        extra={"files": report.files, "bytes": report.bytes, "refused": len(report.refused),
               "seconds": round(time.monotonic() - started, 3)},
    )  # fmt: skip
    return report


def _log_every(period: float) -> Callable[[DrainProgress], None]:
    last = [time.monotonic()]

    def tick(p: DrainProgress) -> None:
        if time.monotonic() - last[0] >= period:
            last[0] = time.monotonic()
            log.info(
                "deleting trash",
                extra={"entry": p.entry, "files": p.files, "total_files": p.total_files,
                       "bytes": p.bytes},
            )  # fmt: skip

    return tick


def _drain_with_bar(
    layout: Layout, store: Store, actor: Actor, pacer: Pacer | None
) -> DeleteReport:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    columns = (BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(
        "deleting purged files", *columns, console=Console(stderr=True), transient=True
    ) as bar:
        task = bar.add_task("delete", total=None)

        def tick(p: DrainProgress) -> None:
            bar.update(task, completed=p.files, total=p.total_files or None)

        return drain_trash(layout, store, actor=actor, pacer=pacer, progress=tick)
