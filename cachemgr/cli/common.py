"""Pieces the namespace commands share: trash deletion with progress, the yes/no prompt."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable

import click

from cachemgr import logs
from cachemgr.fs.deletion import DeleteReport, Pacer
from cachemgr.layout import Layout
from cachemgr.ns.purge import Actor, DrainProgress, drain_trash
from cachemgr.state.store import Store

log = logging.getLogger(__name__)


def drain_with_progress(
    layout: Layout, store: Store, *, actor: Actor, pacer: Pacer | None = None
) -> DeleteReport:
    """Delete the trash now: a progress bar on a terminal, a log line a second otherwise.
    Stopped by another's write lock on the state DB (`stopped`), it says who holds it."""
    if sys.stderr.isatty():
        return _drain_with_bar(layout, store, actor, pacer)
    started = time.monotonic()
    report = drain_trash(
        layout, store, actor=actor, pacer=pacer, progress=_log_every(1.0), locked=_say_locked
    )
    log.log(
        logging.INFO if report.files or report.refused else logging.DEBUG,
        "trash deleted",
        extra={
            "files": report.files,
            "bytes": report.bytes,
            "refused": len(report.refused),
            "seconds": round(time.monotonic() - started, 3),
        },
    )
    return report


def _say_locked(holder: str) -> None:
    log.warning(
        "state DB write-locked: the drain stops; what it deleted is recorded once the lock "
        "is free, the rest stays in .trash/ for the daemon or the next purge",
        extra={"holder": holder},
    )


def _log_every(period: float) -> Callable[[DrainProgress], None]:
    due = logs.every(period)

    def tick(p: DrainProgress) -> None:
        if due():
            logs.PROGRESS.info(
                "deleting trash",
                extra={
                    "entry": p.entry,
                    "files": p.files,
                    "total_files": p.total_files,
                    "bytes": p.bytes,
                },
            )

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

        return drain_trash(
            layout, store, actor=actor, pacer=pacer, progress=tick, locked=_say_locked
        )


def said_not_whole(
    namespaces: Iterable[tuple[str, str, str | None]], state_dir: str | None
) -> bool:
    """Warn on stderr, one line each, of what this user could not read for `ls` or `status`:
    a namespace (id, state, problem) whose dir or manifest is `unreadable`, the state dir.
    True if there was any: the answer is then not whole (exit 1, docs/exit-codes.md)."""
    lines = [f"namespace {ns} {why}" for ns, state, why in namespaces if state == "unreadable"]
    lines += [state_dir] if state_dir else []
    for line in lines:
        click.echo(f"cachemgr: warning: {line}", err=True)
    return bool(lines)


def ask(question: str, *, declined: str) -> None:
    """Ask on the terminal; "no" says `declined` and exits 1 (a decision, not an error and not
    an interrupt: Ctrl-C or a closed stdin stays 130)."""
    if not click.confirm(question, err=True):
        click.echo(declined, err=True)
        raise click.exceptions.Exit(1)
