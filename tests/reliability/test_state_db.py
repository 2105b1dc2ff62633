"""The state DB as a poison: damaged past its header, truncated, zeroed, or deleted under a
running daemon. Every command recovers (moves the DB aside, rebuilds it from disk) or says
one line; the daemon never stops serving and never writes a DB nobody else can see."""

from __future__ import annotations

import json
import os
import random
import sqlite3
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from cachemgr.errors import StateCorrupt
from cachemgr.gc.policy import GcPolicy
from cachemgr.gc.runner import GcRunner
from cachemgr.layout import Layout
from cachemgr.settings import Settings
from cachemgr.state.dbfile import file_id
from cachemgr.state.index import scan_root
from cachemgr.state.store import Store
from tests.daemon_helpers import RunningDaemon, running_daemon, store_page, wait_for
from tests.nsfixtures import cli, make_ns, page_name
from tests.test_gc_race import NO_STORAGE_ENV
from tests.test_identity import make_model

PAGES = 150  # per namespace: the DB (~80 KB) reaches well past the damage at 4096
CORRUPT_MSG = "state DB was corrupt; moved it aside and started a fresh one, rebuilt from disk"


def random_past_header(db: Path) -> None:
    """20,000 random bytes at offset 4096: the header page is intact, the tables are not."""
    with open(db, "r+b") as f:
        f.seek(4096)
        f.write(random.Random(11).randbytes(20_000))


def truncated_to_half(db: Path) -> None:
    os.truncate(db, db.stat().st_size // 2)


def zeroed_header(db: Path) -> None:
    with open(db, "r+b") as f:
        f.write(bytes(100))


DAMAGE = [random_past_header, truncated_to_half, zeroed_header]


@pytest.fixture
def populated(layout: Layout) -> dict[str, int]:
    """Three namespaces (one bound) with pages, indexed; the DB closed (checkpointed)."""
    store = Store.open(layout.db_path)
    found = {make_ns(layout, store, f"model{i}", pages=PAGES): PAGES for i in range(3)}
    make_ns(layout, store, "model0", pages=PAGES, instance="srv0")
    scan_root(layout, store)
    store.close()
    assert layout.db_path.stat().st_size > 30_000
    return found


def corrupt_copies(layout: Layout) -> list[Path]:
    return sorted(
        p
        for p in layout.state_dir.glob("state.db.corrupt-*")
        if not p.name.endswith(("-wal", "-shm"))
    )


def sound(db: Path) -> bool:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return bool(conn.execute("PRAGMA quick_check").fetchall() == [("ok",)])
    finally:
        conn.close()


def indexed_pages(db: Path) -> dict[str, int] | None:
    """Page rows per namespace in the DB now at `db` (read-only: never creates it); None
    while there is none, or it is not migrated yet."""
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            rows = conn.execute("SELECT namespace_id, count(*) FROM pages GROUP BY 1").fetchall()
        finally:
            conn.close()
    except sqlite3.OperationalError:
        return None
    return {str(ns): int(n) for ns, n in rows}


# --- the CLI: each command on a damaged DB -------------------------------------------------


def _ls(root: Path, expected: dict[str, int], out: str) -> None:
    got = {n["ns_id"]: n["pages"] for n in json.loads(out)["namespaces"]}
    assert got == expected


def _status(root: Path, expected: dict[str, int], out: str) -> None:
    got = {n["id"]: n["pages"] for n in json.loads(out)["namespaces"]}
    assert got == expected


def _doctor(root: Path, expected: dict[str, int], out: str) -> None:
    assert "state-db-corrupt" in out


def _gc(root: Path, expected: dict[str, int], out: str) -> None:
    json.loads(out)
    assert {ns: len(list((root / "ns" / ns).iterdir())) for ns in expected} == expected


def _purge_all_dry(root: Path, expected: dict[str, int], out: str) -> None:
    plan = json.loads(out)["plan"]["targets"]
    assert {t["ns_id"]: t["pages"] for t in plan} == expected


def _init(root: Path, expected: dict[str, int], out: str) -> None:
    assert json.loads(out)["outcome"] == "created"


COMMANDS: dict[str, tuple[list[str], int, Callable[[Path, dict[str, int], str], None]]] = {
    "ls": (["ls", "--json"], 0, _ls),
    "status": (["status", "--json", "--port", "1"], 0, _status),
    "doctor": (["doctor"], 1, _doctor),
    "gc": (["gc", "--yes", "--json"], 0, _gc),
    "purge": (["purge", "--all", "--dry-run", "--json"], 0, _purge_all_dry),
    "init": (
        [
            "init",
            "--json",
            "--on-change",
            "retain",
            "--",
            "sglang",
            "serve",
            "--enable-hierarchical-cache",
            "--hicache-storage-backend",
            "file",
            "--model-path",
            "MODEL",
            "--page-size",
            "64",
        ],
        0,
        _init,
    ),
}


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_recovers_from_a_damaged_db(
    root: Path,
    layout: Layout,
    populated: dict[str, int],
    tmp_path: Path,
    damage: Callable[[Path], None],
    command: str,
) -> None:
    args, code, check = COMMANDS[command]
    args = [str(make_model(tmp_path / "model")) if a == "MODEL" else a for a in args]
    damage(layout.db_path)
    out = cli("--root", str(root), *args, env=NO_STORAGE_ENV)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == code, out.stderr
    check(root, populated, out.stdout)
    logs = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    assert [w["msg"] for w in logs if w["level"] == "warning"] == [CORRUPT_MSG]
    assert len(corrupt_copies(layout)) == 1
    assert sound(layout.db_path)
    again = cli("--root", str(root), "ls", "--json")  # the next command finds a sound DB
    assert again.returncode == 0 and again.stderr == "", again.stderr


# --- the store: two users of one corrupt file move it aside once ----------------------------


def test_two_connections_finding_the_same_corruption_move_it_aside_once(
    layout: Layout, populated: dict[str, int]
) -> None:
    a, b = Store.open(layout.db_path), Store.open(layout.db_path)
    try:
        random_past_header(layout.db_path)
        for store in (a, b):
            with pytest.raises(StateCorrupt), store.guard():
                store.conn.execute("SELECT * FROM namespaces").fetchall()
            if store is a:
                fresh = Store.open(layout.db_path)  # the next user starts the fresh DB
                fresh_id = file_id(layout.db_path)
                fresh.close()
        assert len(corrupt_copies(layout)) == 1
        assert file_id(layout.db_path) == fresh_id  # b did not move the fresh DB aside
        assert b.follow_path() and b.conn.execute("SELECT count(*) FROM pages").fetchone()[0] == 0
    finally:
        a.close()
        b.close()


def test_gc_finding_corruption_moves_it_aside_and_runs_on_the_fresh_db(
    layout: Layout, populated: dict[str, int], settings: Settings
) -> None:
    store = Store.open(layout.db_path)
    runner = GcRunner(layout, store, GcPolicy.from_settings(settings))
    try:
        random_past_header(layout.db_path)
        with pytest.raises(StateCorrupt):
            runner.needs_gc()
        assert runner.needs_gc() == ()  # reopened at the path: a fresh, sound DB
        assert file_id(layout.db_path) == store.opened and sound(layout.db_path)
    finally:
        store.close()


def test_quick_check_at_open_moves_aside_what_a_plain_open_misses(
    layout: Layout, populated: dict[str, int]
) -> None:
    random_past_header(layout.db_path)
    Store.open(layout.db_path).close()  # the header is fine: a plain open sees nothing
    assert corrupt_copies(layout) == []
    with Store.open(layout.db_path, check=True) as store:
        assert store.conn.execute("SELECT count(*) FROM namespaces").fetchone()[0] == 0
    assert len(corrupt_copies(layout)) == 1


# --- the daemon ------------------------------------------------------------------------------


@pytest.fixture
def daemon(settings: Settings, populated: dict[str, int]) -> Iterator[RunningDaemon]:
    fast = settings.model_copy(
        update={"batch_interval": 0.05, "gc_interval": timedelta(seconds=0.2)}
    )
    with running_daemon(fast) as d:
        yield d


def serving(d: RunningDaemon, expected: dict[str, int]) -> bool:
    """The daemon answers /v1/status with these namespaces and page counts."""
    try:
        r = d.get("/v1/status")
    except httpx.TransportError:
        return False
    if r.status_code != 200:
        return False
    return {ns["id"]: ns["pages"] for ns in r.json()["namespaces"]} == expected


def alive(d: RunningDaemon) -> None:
    assert d.daemon.indexer.error is None
    assert d.daemon.server is not None and not d.daemon.server.should_exit
    assert d.get("/healthz").status_code == 200


@pytest.mark.parametrize("damage", DAMAGE)
def test_the_daemon_starts_on_a_damaged_db(
    layout: Layout,
    populated: dict[str, int],
    settings: Settings,
    damage: Callable[[Path], None],
) -> None:
    damage(layout.db_path)
    with running_daemon(settings) as d:
        wait_for(lambda: serving(d, populated), bool)
        alive(d)
        assert len(corrupt_copies(layout)) == 1
        assert indexed_pages(layout.db_path) == populated


def test_corruption_while_running_is_moved_aside_and_rebuilt(
    layout: Layout, populated: dict[str, int], daemon: RunningDaemon
) -> None:
    wait_for(lambda: serving(daemon, populated), bool)
    scrapes: list[int] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            scrapes.append(daemon.http.get("/metrics").status_code)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        size = layout.db_path.stat().st_size
        with open(layout.db_path, "r+b") as f:  # every page but the header
            f.seek(4096)
            f.write(random.Random(5).randbytes(size - 4096))
        ns = sorted(populated)[0]
        store_page(layout.ns_dir(ns), page_name(PAGES))  # a write: every cache is dropped
        expected = {**populated, ns: PAGES + 1}
        wait_for(lambda: len(corrupt_copies(layout)), bool)
        wait_for(lambda: serving(daemon, expected), bool)
        wait_for(lambda: indexed_pages(layout.db_path), lambda got: got == expected)
    finally:
        stop.set()
        scraper.join(10)
    alive(daemon)
    assert sound(layout.db_path)
    assert scrapes and set(scrapes) == {200}


@pytest.mark.parametrize("cli_first", [False, True], ids=["alone", "cli-recreates-it"])
def test_a_db_deleted_under_the_daemon_is_reopened_and_rebuilt(
    root: Path,
    layout: Layout,
    populated: dict[str, int],
    daemon: RunningDaemon,
    cli_first: bool,
) -> None:
    wait_for(lambda: serving(daemon, populated), bool)
    before = file_id(layout.db_path)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{layout.db_path}{suffix}").unlink(missing_ok=True)
    if cli_first:  # a CLI run makes a fresh DB at the path before the daemon notices
        assert cli("--root", str(root), "ls", "--json").returncode == 0
    wait_for(lambda: file_id(layout.db_path), lambda got: got not in (None, before))
    wait_for(lambda: indexed_pages(layout.db_path), lambda got: got == populated)
    # One DB: what the daemon indexes now lands in the file at the path, and it serves that.
    ns = sorted(populated)[1]
    store_page(layout.ns_dir(ns), page_name(PAGES))
    expected = {**populated, ns: PAGES + 1}
    wait_for(lambda: indexed_pages(layout.db_path), lambda got: got == expected)
    wait_for(lambda: serving(daemon, expected), bool)
    out = cli("--root", str(root), "ls", "--json")
    assert {n["ns_id"]: n["pages"] for n in json.loads(out.stdout)["namespaces"]} == expected
    alive(daemon)
