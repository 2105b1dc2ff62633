"""The daemon learns prefix chains from the pages a server reads and writes, keeps the cap
at once when writes cross it, evicts tails first and quiet chains first, and remembers what
it learned across a restart."""

from __future__ import annotations

import itertools
import os
import sqlite3
import time
from pathlib import Path

from cachemgr.daemon.events import LOCAL, Kind
from cachemgr.daemon.page_events import PageEvents
from cachemgr.fs._dirscan import birth_time
from cachemgr.fs.root import create_root
from cachemgr.gc.chains import BURST_GAP, ChainModel
from cachemgr.layout import Layout
from cachemgr.settings import Settings, load_settings
from cachemgr.state.store import Store
from tests.daemon_helpers import (
    NS_A,
    page_name,
    read_page,
    register_namespace,
    running_daemon,
    store_burst,
    store_page,
)
from tests.polling import wait_for

PAGE = 1000
SYSTEM = [1, 2, 3, 4]  # a system prompt every session starts with


class Server:
    """Reads and writes pages as SGLang's HiCacheFile does for one request at a time."""

    def __init__(self, d: Path) -> None:
        self.d = d

    def request(self, chain: list[int]) -> None:
        """Hits: the longest prefix on disk, read head to tail; the rest is written."""
        n = 0
        while n < len(chain) and (self.d / page_name(chain[n])).exists():
            n += 1
        for p in chain[:n]:
            read_page(self.d, page_name(p))
        store_burst(self.d, [page_name(p) for p in chain[n:]], PAGE)

    def on_disk(self) -> set[int]:
        return {int(n[:64], 16) for n in (p.name for p in self.d.iterdir()) if n.endswith(".bin")}


def _settings(layout: Layout, cap_pages: int) -> Settings:
    return load_settings(
        root=layout.root,
        gc_max_bytes=cap_pages * PAGE,
        gc_high_watermark=1.0,
        gc_low_watermark=0.9,
        gc_interval=3600,
        batch_interval=0.05,
    )


def _db_preds(layout: Layout) -> dict[int, int | None]:
    with sqlite3.connect(layout.db_path) as conn:
        rows = conn.execute("SELECT name, pred FROM pages").fetchall()
    return {int(n[:64], 16): None if p is None else int(p, 16) for n, p in rows}


def test_chains_are_learned_and_evicted_tails_first_quiet_chains_first(tmp_path: Path) -> None:
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    d = register_namespace(layout, NS_A, instance="gpu0")
    server = Server(d)
    once = [*SYSTEM, 100, 101, 102, 103]  # a session seen once
    hot = [*SYSTEM, *range(200, 206)]  # a session that keeps returning
    with running_daemon(_settings(layout, cap_pages=40)) as dm:
        server.request(once)
        for turn in range(1, 4):
            server.request(hot[: 4 + 2 * turn])
        applied = dm.daemon.indexer.state
        wait_for(lambda: applied.events_applied, lambda n: n >= 28, timeout=30, what="events")
        # Later sessions push the cache over its cap of 40 pages.
        for s in range(5):
            server.request(hot)  # the hot session keeps returning meanwhile
            server.request([*SYSTEM, *range(1000 * (s + 1), 1000 * (s + 1) + 8)])
        on_disk = wait_for(server.on_disk, lambda p: len(p) <= 40, timeout=30, what="the cap")
        assert set(hot) <= on_disk  # the returning chain stayed whole
        assert not set(once[4:]) & on_disk  # the chain seen once went first
        # Whatever stays is a usable prefix: no page on disk behind a missing one.
        for chain in [once, hot, *[[*SYSTEM, *range(k, k + 8)] for k in range(1000, 6000, 1000)]]:
            present = [p in on_disk for p in chain]
            assert present == sorted(present, reverse=True), chain
        learned = wait_for(lambda: _db_preds(layout), lambda p: p.get(205) == 204, timeout=30)
    assert learned[200] == SYSTEM[-1] and learned[2] == 1
    # A restart keeps the links: the model is rebuilt from the index.
    with running_daemon(_settings(layout, cap_pages=40)) as dm:
        model = dm.daemon.indexer.model
        wait_for(lambda: len(model.pages), lambda n: n >= len(on_disk) - 8, timeout=30)
        with model.lock:
            pred = {int(k, 16): p.pred for (_, k), p in model.pages.items()}
        assert pred[205] == f"{204:064x}" and pred[200] == f"{4:064x}"


def test_a_backlog_of_stores_seen_at_once_is_told_apart_by_mtime(tmp_path: Path) -> None:
    """A daemon that lags behind the writer reads a backlog of stores at once, all seen at
    one time: each request's burst is still its own chain (the files' mtimes say when they
    were written), not one chain of every store."""
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    d = register_namespace(layout, NS_A, instance="gpu0")
    model = ChainModel()
    with Store.open(layout.db_path) as store:
        pages = PageEvents(layout, store, model=model)
        events = []
        for n in range(20):  # one page per request, 20 ms apart
            store_page(d, page_name(n), PAGE)
            os.utime(d / page_name(n), (1000 + 0.02 * n, 1000 + 0.02 * n))
            events.append((Kind.WRITE, NS_A, page_name(n), 5.0, LOCAL))
        pages.apply(events, now=2000.0)
    assert all(p.pred is None for p in model.pages.values())


def _write_slowly(d: Path, name: str) -> None:
    """A page written as HiCacheFile writes a big one: a temp file, written for 25 ms (its
    mtime is when its last write() began), then renamed into place (its ctime)."""
    tmp = d / f".{name[:8]}.tmp"
    with open(tmp, "wb") as f:
        f.write(b"\x01" * PAGE)
        f.flush()
        time.sleep(0.025)
        f.write(b"\x01" * PAGE)
    os.replace(tmp, d / name)


def _request_written_slowly(d: Path, pages: list[int]) -> list[float]:
    """Write these pages back to back, slowly each; the gaps from each one's rename to the
    next one's birth, by the files' own times."""
    for n in pages:
        _write_slowly(d, page_name(n))
    times = [(birth_time(str(d / page_name(n))), os.stat(d / page_name(n)).st_ctime) for n in pages]
    assert all(b is not None for b, _ in times), "the test's filesystem keeps no birth times"
    return [b - c for (_, c), (b, _) in itertools.pairwise(times) if b is not None]


def test_pages_of_megabytes_written_back_to_back_are_one_chain(tmp_path: Path) -> None:
    """SGLang's 8 MiB pages are 22-33 ms apart by mtime (each takes that long to write), far
    past BURST_GAP, yet each one's temp file is made right after the one before it was
    renamed: a burst by birth time. The next request's page, begun 30 ms after the last one
    was renamed, is not linked to it."""
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    d = register_namespace(layout, NS_A, instance="gpu0")
    for attempt in range(5):  # (a writer paused past BURST_GAP between two pages: again)
        request = [10 * attempt + i for i in range(4)]
        if max(_request_written_slowly(d, request)) <= BURST_GAP:
            break
    time.sleep(0.03)
    _write_slowly(d, page_name(100))  # the next request's first page
    model = ChainModel()
    with Store.open(layout.db_path) as store:
        events = [(Kind.WRITE, NS_A, page_name(n), 5.0, LOCAL) for n in [*request, 100]]
        PageEvents(layout, store, model=model).apply(events, now=time.time())
    mtimes = [os.stat(d / page_name(n)).st_mtime for n in request]
    assert min(b - a for a, b in itertools.pairwise(mtimes)) > BURST_GAP  # apart by mtime
    pred = {int(k, 16): p.pred and int(p.pred, 16) for (_, k), p in model.pages.items()}
    assert [pred[n] for n in [*request, 100]] == [None, *request[:3], None]
