"""A free-space floor pass while the state DB takes no writes (its filesystem full, apart from
the root's; its write lock held elsewhere): the pass needs no DB, so it deletes pages all the
same, and its audit row used to be dropped ("floor pass not audited"), or lost with the error,
leaving no record of the deletion. It is said at once in a structured WARNING line (files,
bytes, namespaces), held in memory (cachemgr.gc.held), and written to the audit table as soon
as the DB takes writes again; the audit's metric then counts it.

(A state dir made chmod 000 under a running daemon does not lose the row: SQLite writes through
the connection's open files. test_unusable_state_dir covers that case.)
"""

from __future__ import annotations

import shutil
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cachemgr.fs.root import create_root
from cachemgr.gc.floor import record_floor
from cachemgr.gc.held import AuditRow, HeldAudits
from cachemgr.gc.step import GcReport, GcStep, StepResult
from cachemgr.layout import RESERVE_FILE, Layout
from cachemgr.state.store import Store
from tests.daemon_helpers import NS_A, page_name, register_namespace, store_page
from tests.polling import wait_for
from tests.reliability.conftest import fill_with_pages
from tests.reliability.test_unusable_ns import Daemon, daemon, lines

FLOOR_PERCENT = 20.0
HELD = "floor pass not audited yet: the state DB takes no writes; held until it does"
WRITTEN = "held audit rows written: the state DB takes writes again"
DELETED = "deleted from a scan of the disk: free space below the floor"


def _floor_audit(layout: Layout) -> tuple[int, int, int]:
    """(rows, pages, bytes) of the floor's audit rows."""
    conn = sqlite3.connect(f"file:{layout.db_path}?mode=ro", uri=True, timeout=30)
    try:
        rows, pages, size = conn.execute(
            "SELECT count(*), coalesce(sum(pages), 0), coalesce(sum(bytes), 0) FROM audit"
            " WHERE action = 'evict' AND reason = 'free_space'"
        ).fetchone()
    finally:
        conn.close()
    return int(rows), int(pages), int(size)


def _said_deleted(log: Path) -> tuple[int, int]:
    """(files, bytes) every floor pass said it deleted, held or audited at once."""
    said = lines(log, DELETED)
    return sum(int(p["files"]) for p in said), sum(int(p["bytes"]) for p in said)


def _reserve_released(layout: Layout) -> bool:
    return (layout.state_dir / RESERVE_FILE).stat().st_blocks == 0


@contextmanager
def _state_fs_full(layout: Layout, d: Daemon) -> Iterator[None]:
    """The state DB's own filesystem full, its space reserve given back (an index write that
    failed for lack of space released it); room again on leaving."""
    junk = layout.state_dir.parent / "junk"
    fill_with_pages(junk)
    store_page(layout.ns_dir(NS_A), page_name(1))  # an index write: ENOSPC, reserve released
    wait_for(lambda: _reserve_released(layout), timeout=30, what="the reserve released")
    fill_with_pages(layout.state_dir.parent / "junk2")  # and what it gave back
    assert d.alive()
    try:
        yield
    finally:
        shutil.rmtree(junk)
        shutil.rmtree(layout.state_dir.parent / "junk2")


@contextmanager
def _write_locked(layout: Layout, d: Daemon) -> Iterator[None]:
    """Another connection holds the state DB's write lock past every writer's patience."""
    conn = sqlite3.connect(layout.db_path, isolation_level=None, timeout=30)
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        conn.execute("ROLLBACK")
        conn.close()


@pytest.mark.parametrize(
    "blocked", [_state_fs_full, _write_locked], ids=["state-fs-full", "locked"]
)
def test_a_floor_pass_the_state_db_takes_no_write_of_is_said_and_audited_later(
    small_fs: Path, other_small_fs: Path, free_port: int, blocked: object
) -> None:
    layout = Layout.at(small_fs / "root", other_small_fs / "state")
    create_root(layout)
    register_namespace(layout, NS_A, instance="sglang-a")
    log = small_fs.parent / "daemon.log"
    env = {
        "CACHEMGR_GC_MIN_FREE_PERCENT": str(FLOOR_PERCENT),
        "CACHEMGR_STATE_DIR": str(layout.state_dir),
    }
    total = shutil.disk_usage(small_fs).total
    with daemon(layout.root, free_port, log, env) as d:
        floor = total * FLOOR_PERCENT / 100

        def passes() -> tuple[int, float, bool]:
            """(passes said held, rows held, the root back over the floor)"""
            over = shutil.disk_usage(small_fs).free >= floor
            return len(lines(log, HELD)), d.metric("cachemgr_gc_audit_rows_held"), over

        def settled() -> tuple[tuple[int, float, bool], ...]:
            """Two looks a second apart: a pass still deleting has the root over the floor
            already but has not said so yet, and it would end after the lock is released."""
            first = passes()
            time.sleep(1.0)
            return first, passes()

        with blocked(layout, d):  # type: ignore[operator]
            fill_with_pages(layout.ns_dir(NS_A))  # old pages, to ENOSPC: below the floor
            # A pass may run while the pages are written, and the writer take the room it
            # freed: then a second one brings the root back over the floor. Each is held.
            wait_for(
                settled,
                lambda s: s[0] == s[1] and s[1][0] >= 1 and s[1][0] == s[1][1] and s[1][2],
                timeout=90,
                what=HELD,
            )
            assert d.alive()
        held = lines(log, HELD)
        for h in held:
            assert h["level"] == "warning", h
            assert isinstance(h["files"], int) and h["files"] > 0, h
            assert isinstance(h["bytes"], int) and h["bytes"] > 0, h
            assert h["namespaces"] == [NS_A], h
        files = sum(int(h["files"]) for h in held)
        wait_for(lambda: lines(log, WRITTEN), timeout=60, what=WRITTEN)
        # Every pass's deletion is in the audit exactly once: the held ones written now, and
        # one that was still waiting out the lock when it was released (under load) at once.
        wait_for(
            lambda: (_floor_audit(layout)[1:], _said_deleted(log)),
            lambda a: a[0] == a[1],
            timeout=30,
            what="the audit of every floor pass",
        )
        rows, audited, size = _floor_audit(layout)
        assert rows >= len(held) and audited >= files
        wait_for(
            lambda: d.metric("cachemgr_evicted_bytes_total", reason="free_space"),
            lambda v: v == size,
            timeout=30,
            what="the audit's metric counting the held rows",
        )
        assert d.metric("cachemgr_gc_audit_rows_held") == 0
        assert d.metric("cachemgr_gc_audit_rows_dropped_total") == 0
    assert d.proc.returncode == 0, log.read_text()[-3000:]
    assert len(lines(log, HELD)) == len(held)  # each said once, written once
    assert not lines(log, "audit rows never written: the state DB took no writes until the end")


def test_held_rows_past_the_bound_drop_the_oldest_and_count_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [AuditRow("evict", "free_space", "auto", i, i * 1000, 1.7e9 + i) for i in range(1, 4)]
    held = HeldAudits(limit=2)
    held.hold(rows)
    assert (len(held), held.dropped) == (2, 1)
    (dropped,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert dropped.__dict__["pages"] == 1 and dropped.__dict__["bytes"] == 1000
    with Store.open(tmp_path / "state.db") as store:
        held.write(store)
        audited = store.conn.execute("SELECT pages, bytes, at FROM audit ORDER BY id").fetchall()
    assert [tuple(r) for r in audited] == [(r.pages, r.bytes, r.at) for r in rows[1:]]
    assert len(held) == 0


def _floor_report(files: int) -> GcReport:
    step = GcStep("free_space", f"ns/{NS_A}", NS_A, (page_name(1),), 4096)
    return GcReport(False, True, 1.7e9, 1.7e9, (StepResult(step, files, files * 4096),))


@pytest.mark.parametrize("files", [0, 3])
def test_only_a_floor_pass_that_deleted_something_is_held_and_said(
    tmp_path: Path, files: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The DB takes no write (a closed connection here: any sqlite3 error does the same). A
    pass that deleted nothing has no row to lose: nothing is held, no 'not audited' line."""
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    store = Store.open(layout.db_path)
    store.close()
    held = HeldAudits()
    with pytest.raises(sqlite3.Error):
        record_floor(layout, store, _floor_report(files), "auto", held)
    said = [r for r in caplog.records if r.getMessage() == HELD]
    assert (len(held), len(said)) == ((1, 1) if files else (0, 0))
