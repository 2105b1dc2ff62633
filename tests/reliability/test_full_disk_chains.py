"""A batch of page events the full disk refused is applied again later: the chain model, which
saw it the first time, must not learn it twice (reads counted again, the stream's order looped
back onto itself), nor may the writer's pace count its bytes again."""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path

import pytest

from cachemgr.daemon.events import LOCAL, Kind
from cachemgr.daemon.page_events import PageEvents
from cachemgr.fs.root import create_root
from cachemgr.gc.chains import ChainModel
from cachemgr.layout import RESERVE_FILE, Layout
from cachemgr.state.store import Store
from tests.daemon_helpers import NS_A, page_name


def fill(path: Path) -> None:
    """Write `path` until ENOSPC: nothing is left for the state DB."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    for size in (4096, 512, 1):  # the last corners
        try:
            with open(path, "ab") as f:
                while True:
                    f.write(b"\0" * size)
                    f.flush()
        except OSError:
            pass


def test_a_refused_batch_is_learned_once(small_fs: Path) -> None:
    layout = Layout.at(small_fs / "root")
    create_root(layout)
    d = layout.ns_dir(NS_A)
    d.mkdir()
    with Store.open(layout.db_path) as store:
        _learn_through_a_full_disk(small_fs, layout, store)


def _learn_through_a_full_disk(small_fs: Path, layout: Layout, store: Store) -> None:
    d = layout.ns_dir(NS_A)
    (layout.state_dir / RESERVE_FILE).unlink(missing_ok=True)  # (the indexer releases it)
    model = ChainModel()
    pages = PageEvents(layout, store, model=model)
    chain = [page_name(i) for i in range(2000)]
    for name in chain:
        (d / name).write_bytes(b"\1" * 100)
    pages.apply([(Kind.WRITE, NS_A, n, 0.0, LOCAL) for n in chain], now=1.0)
    stored = pages.stored_bytes
    reads = [(Kind.READ, NS_A, n, 0.0, LOCAL) for n in chain]
    fill(small_fs / "filler")
    for _ in range(3):  # the index thread retries while GC frees space
        with pytest.raises(sqlite3.OperationalError):
            pages.apply(reads, now=2.0)
    os.unlink(small_fs / "filler")
    pages.apply(reads, now=3.0)
    head, second = (NS_A, chain[0][:64]), (NS_A, chain[1][:64])
    assert model.pages[head].reads == 1 and model.pages[second].reads == 1
    assert model.pages[head].pred is None and model.pages[second].pred == head[1]
    assert pages.stored_bytes == stored
    row = store.conn.execute("SELECT reads FROM pages WHERE name = ?", (chain[0],)).fetchone()
    assert row[0] == 1
