"""The chain model survives a daemon restart through a snapshot saved at a clean stop: chains,
recency, the learner's votes and the eviction order's segments, so the victims after a restart
are those before it. A snapshot that is damaged, stale or from another index is never used:
the model is then loaded from the index, exactly as without a snapshot (also after kill -9)."""

from __future__ import annotations

import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cachemgr.fs.root import create_root
from cachemgr.gc import modelfile
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.pagestore import Page, PageId
from cachemgr.gc.value import eviction_order
from cachemgr.layout import Layout
from cachemgr.settings import Settings, load_settings
from cachemgr.state import pages_sql
from cachemgr.state.store import Store
from tests.daemon_helpers import (
    NS_A,
    RunningDaemon,
    page_name,
    read_page,
    register_namespace,
    running_daemon,
    store_burst,
)
from tests.daemon_helpers import store_page as write_page
from tests.mounts import tmpfs
from tests.polling import wait_for
from tests.test_chain_store import NS, SUFFIX, block_path, chains

SYSTEM = [1, 2, 3]
LONG = 20  # pages a session writes: a segment the order keeps (more than value.CACHED)


def victims(model: ChainModel) -> list[tuple[str, str]]:
    return [(v.namespace_id, v.key) for v in eviction_order(model, before=math.inf)]


def pages(model: ChainModel) -> dict[PageId, Page]:
    return dict(model.pages)


def saved_model(tmp_path: Path, store: Store) -> tuple[ChainModel, Path]:
    """A model with chains, keys of another shape and an order run (segments kept), saved."""
    model = ChainModel()
    chains(model, 3000, 40)
    for i, k in enumerate(["00ab", "ABCDEF" + "0" * 58]):
        model.add(NS, k + SUFFIX, len(k), 10, seq=5000 + i, at=1.0, pred="00ab" if i else None)
    for i in range(4):  # vLLM blocks: keys packed with their shapes (g0 and g1)
        path = block_path(i, i % 2)
        model.add(NS, path, len(path), 48, seq=5100 + i, at=1.0)
    h = "ab" * 32  # a dir that repeats its run's lead, then a letter: the offset 0 is a NUL
    path = f"x/{h[:3]}q/{h}.bin"
    model.add(NS, path, len(path), 48, seq=5200, at=1.0)
    victims(model)  # fills the segment cache
    model.observe_read(NS, f"{7 * 2654435761:064x}" + SUFFIX, 64, seq=6000, at=2.0)  # (dirty)
    path = tmp_path / "chain-model.snapshot"
    modelfile.save(model, path, store, [NS])
    return model, path


def test_a_restored_model_is_the_saved_one(tmp_path: Path, store: Store) -> None:
    model, path = saved_model(tmp_path, store)
    restored = ChainModel()
    assert modelfile.restore(restored, path, store) == {NS}
    assert pages(restored) == pages(model)  # links, recency, reads, votes, files
    assert restored.segments == model.segments and restored.dirty == model.dirty
    assert restored.clock == model.clock
    assert victims(restored) == victims(model)
    # It goes on learning as the saved one does (the key table and free slots came along).
    for m in (model, restored):
        m.add(NS, "ff" * 32 + SUFFIX, 64, 7, seq=7000, at=3.0, pred=f"{0:064x}")
        m.remove(NS, [("00ab" + SUFFIX, 4)])
    assert pages(restored) == pages(model) and victims(restored) == victims(model)
    # The start-up took the stamp: the same file is not used twice.
    assert modelfile.restore(ChainModel(), path, store) == set()


def _truncate(path: Path, store: Store) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _garble(path: Path, store: Store) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) * 2 // 3] ^= 0x40  # one bit, in the arrays
    path.write_bytes(bytes(raw))


def split(raw: bytes) -> tuple[dict[str, Any], bytes]:
    """A model file's header, and the arrays after it (without the CRC at the end)."""
    start = len(modelfile.MAGIC) + 8
    end = start + int.from_bytes(raw[start - 8 : start], "little")
    return json.loads(raw[start:end]), raw[end:-4]


def joined(header: dict[str, Any], body: bytes) -> bytes:
    """A model file of this header and these arrays, with its CRC made right."""
    text = json.dumps(header).encode()
    raw = modelfile.MAGIC + len(text).to_bytes(8, "little") + text + body
    return raw + zlib.crc32(raw).to_bytes(4, "little")


def _header(path: Path, change: dict[str, int]) -> None:
    """Change header fields, keeping the header's length field right (the CRC is not)."""
    raw = path.read_bytes()
    start = len(modelfile.MAGIC) + 8
    end = start + int.from_bytes(raw[start - 8 : start], "little")
    header = json.loads(raw[start:end]) | change
    new = json.dumps(header).encode()
    path.write_bytes(raw[: start - 8] + len(new).to_bytes(8, "little") + new + raw[end:])


def _huge_length(path: Path, store: Store) -> None:
    _header(path, {"top": 10**12})  # (never allocated: longer than the file)


def _huge_array(path: Path, store: Store) -> None:
    _header(path, {"table": 2**40})


def _huge_sparse(path: Path, store: Store) -> None:
    """A length the file holds, as a hole: more memory than the machine has."""
    _header(path, {"table": 2**40})
    os.truncate(path, 2**43)


def _short_array(path: Path, store: Store) -> None:
    _header(path, {"segments": 1})  # the arrays after it read shifted: the CRC fails


def _shapes_cut(path: Path, store: Store) -> None:
    """A key shape's mark cut short, the CRC made right (a writer's bug, a hand's edit): an
    eviction naming such a block would fail, not its restore."""
    header, body = split(path.read_bytes())
    before = next(b for b, _ in header["shapes"] if "\0" in b)
    header["shapes"] = [
        [b[: b.index("\0") + 2], a] if b == before else [b, a] for b, a in header["shapes"]
    ]
    path.write_bytes(joined(header, body))


def _shapes_few(path: Path, store: Store) -> None:
    """Fewer shapes than the slots' numbers name, the CRC made right."""
    header, body = split(path.read_bytes())
    header["shapes"] = header["shapes"][:1]
    path.write_bytes(joined(header, body))


def _append(path: Path, store: Store) -> None:
    path.write_bytes(path.read_bytes() + b"\0")


def _index_changed(path: Path, store: Store) -> None:
    with store.transaction() as conn:  # (any change to `pages`: here a CLI's scan finding one)
        conn.execute(
            "INSERT INTO pages (namespace_id, name, size, created_at, last_access, key_len)"
            " VALUES (?, ?, 1, 0, 0, 64)",
            (NS, "ee" * 32 + SUFFIX),
        )


def _older_file(path: Path, store: Store) -> None:
    old = path.read_bytes()
    modelfile.save(ChainModel(), path, store, [])  # a later stop stamped the index for its file
    path.write_bytes(old)


def _missing(path: Path, store: Store) -> None:
    path.unlink()


def _symlink(path: Path, store: Store) -> None:
    """The valid file moved out of the state dir and a link to it put in its place."""
    away = path.parent / "elsewhere"
    away.mkdir()
    path.rename(away / path.name)
    path.symlink_to(away / path.name)


@pytest.mark.parametrize(
    "damage",
    [
        _truncate,
        _garble,
        _huge_length,
        _huge_array,
        _huge_sparse,
        _short_array,
        _shapes_cut,
        _shapes_few,
        _append,
        _index_changed,
        _older_file,
        _missing,
        _symlink,
    ],
)
def test_a_damaged_or_stale_snapshot_is_not_used(
    tmp_path: Path, store: Store, damage: Callable[[Path, Store], None]
) -> None:
    _, path = saved_model(tmp_path, store)
    damage(path, store)
    model = ChainModel()
    assert modelfile.restore(model, path, store) == set()
    assert not model.pages and not model.segments  # left as it was: the caller loads the index


def _settings(layout: Layout) -> Settings:
    return load_settings(root=layout.root, gc_interval=3600, batch_interval=0.05)


def _sessions(d: Path, first: int, n: int) -> int:
    """`n` sessions behind a shared system prompt, some read again: the learner's input.
    Returns how many page files were accessed."""
    new = [p for p in SYSTEM if not (d / page_name(p)).exists()]
    store_burst(d, [page_name(p) for p in new])
    done = len(new)
    for s in range(first, first + n):
        chain = [100 * s + i for i in range(LONG)]
        for p in SYSTEM:  # the prefix read, then the request's new pages written
            read_page(d, page_name(p))
        store_burst(d, [page_name(p) for p in chain])
        done += len(SYSTEM) + len(chain)
        if s % 3 == 0:  # a session that returns: its prefix is read head to tail
            for p in (*SYSTEM, *chain):
                read_page(d, page_name(p))
            done += len(SYSTEM) + len(chain)
    return done


def _index_model(layout: Layout) -> ChainModel:
    with sqlite3.connect(layout.db_path) as conn:
        return ChainModel.from_index(conn, [NS_A])


def _root(tmp_path: Path) -> tuple[Layout, Path]:
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    return layout, register_namespace(layout, NS_A, instance="gpu0")


def _serve(dm: RunningDaemon, d: Path, first: int, n: int) -> ChainModel:
    """`n` sessions through a running daemon, applied; its model."""
    accessed = _sessions(d, first, n)
    state = dm.daemon.indexer.state
    wait_for(lambda: state.events_applied, lambda k: k >= accessed, timeout=30)
    return dm.daemon.indexer.model


def test_a_restart_keeps_chains_recency_and_order(tmp_path: Path) -> None:
    layout, d = _root(tmp_path)
    with running_daemon(_settings(layout)) as dm:
        model = _serve(dm, d, 1, 12)
        with model.lock:
            before, order = pages(model), victims(model)  # (the order fills its segments)
            segments = dict(model.segments)
    assert len(before) == len(SYSTEM) + LONG * 12 and segments
    assert sum(p.pred is not None for p in before.values()) >= LONG * 12  # chains were learned
    assert layout.model_snapshot.is_file()
    with running_daemon(_settings(layout)) as dm:
        model = dm.daemon.indexer.model
        with model.lock:
            assert pages(model) == before  # chains, recency, reads, the learner's votes
            assert model.segments == segments  # the first order walks no segment again
            assert victims(model) == order
        # It learns on from there: a new session is indexed and linked.
        _sessions(d, 20, 1)
        wait_for(lambda: model.pages.get((NS_A, f"{2019:064x}")), bool, timeout=30)
    with running_daemon(_settings(layout)) as dm:  # and that is saved at the next stop again
        assert (NS_A, f"{2019:064x}") in dm.daemon.indexer.model.pages


def test_a_garbled_snapshot_gives_the_model_of_the_index(tmp_path: Path) -> None:
    layout, d = _root(tmp_path)
    with running_daemon(_settings(layout)) as dm:
        _serve(dm, d, 1, 6)
    with Store.open(layout.db_path) as store:
        _garble(layout.model_snapshot, store)
    with running_daemon(_settings(layout)) as dm:
        model = dm.daemon.indexer.model
        with model.lock:
            assert pages(model) == pages(_index_model(layout))
            assert victims(model) == victims(_index_model(layout))
            assert len(model.pages) == len(SYSTEM) + LONG * 6


def test_after_kill_9_the_model_is_loaded_from_the_index(tmp_path: Path) -> None:
    """A daemon killed leaves no stamp (it took it at start): the snapshot of the stop before
    is stale, and the next start loads what the killed daemon stored in the index."""
    layout, d = _root(tmp_path)
    with running_daemon(_settings(layout)) as dm:  # a clean stop: a snapshot of 3 + LONG pages
        _serve(dm, d, 1, 1)
    stale = layout.model_snapshot.read_bytes()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cachemgr", "--root", str(layout.root), "serve", "--port", "0"],
        env={**os.environ, "CACHEMGR_BATCH_INTERVAL": "0.05"},
        stderr=subprocess.DEVNULL,
    )
    try:
        with Store.open(layout.db_path) as store:  # the killed daemon took the stamp at start
            wait_for(
                lambda: store.conn.execute("SELECT count(*) FROM model_stamp").fetchone(),
                lambda r: r[0] == 0,
                timeout=60,
                what="the daemon's start",
            )
        _sessions(d, 2, 6)
        wait_for(lambda: _index_model(layout).pages, lambda p: len(p) == 3 + LONG * 7, timeout=60)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert layout.model_snapshot.read_bytes() == stale  # nothing was saved
    with running_daemon(_settings(layout)) as dm:
        model = dm.daemon.indexer.model
        with model.lock:
            assert pages(model) == pages(_index_model(layout))
            assert len(model.pages) == 3 + LONG * 7
            assert victims(model) == victims(_index_model(layout))


def test_the_stamp_goes_with_any_change_to_the_index(store: Store) -> None:
    for change in (
        "INSERT INTO pages (namespace_id, name, size, created_at, last_access, key_len)"
        " VALUES ('n', 'k_x', 1, 0, 0, 1)",
        "UPDATE pages SET reads = reads + 1",
        "UPDATE pages SET pred = 'j'",
        "DELETE FROM pages",
    ):
        with store.transaction() as conn:
            pages_sql.set_model_stamp(conn, "t")
        with store.transaction() as conn:
            conn.execute(change)
        with store.transaction() as conn:
            assert pages_sql.take_model_stamp(conn) is None, change
    with store.transaction() as conn:
        pages_sql.set_model_stamp(conn, "t")
    with store.transaction() as conn:
        assert pages_sql.take_model_stamp(conn) == "t"
        assert pages_sql.take_model_stamp(conn) is None


def test_files_changed_while_the_daemon_was_down_are_applied_to_the_snapshot(
    tmp_path: Path,
) -> None:
    """The server writes on while the daemon restarts: the start-up scan finds new files and
    files gone, and the restored model takes just those (its learned votes stay), ending as a
    load from the index would (but for what only the live model knew)."""
    layout, d = _root(tmp_path)
    with running_daemon(_settings(layout)) as dm:
        _serve(dm, d, 1, 6)
    for i in range(3):
        write_page(d, page_name(9000 + i))  # while no daemon watches
    (d / page_name(100 * 3 + LONG - 1)).unlink()  # a tail gone (another evictor)
    with running_daemon(_settings(layout)) as dm:
        model = dm.daemon.indexer.model
        with model.lock:
            got, want = pages(model), pages(_index_model(layout))
        # (born: the live model has a page's first write; the index, the seq of the last
        # access of the batch that stored it, cachemgr/daemon/page_events.py)
        assert {p: g._replace(conf=0, born=0) for p, g in got.items()} == {
            p: w._replace(born=0) for p, w in want.items()
        }
        assert (NS_A, f"{9001:064x}") in got and (NS_A, f"{300 + LONG - 1:064x}") not in got
        assert any(p.conf for p in got.values())  # not loaded again: the votes are the saved ones


def test_no_snapshot_takes_the_last_of_the_disk(tmp_path: Path, store: Store) -> None:
    """The state dir is usually on the cache's filesystem, where the server writes: a file
    that would leave less than 3x its size free is not written (the next start loads)."""
    with tmpfs(tmp_path / "small", "4m") as small:
        model = ChainModel()
        chains(model, 20_000, 40)  # a file of ~2.3 MB
        modelfile.save(model, small / "chain-model.snapshot", store, [NS])
        assert not list(small.iterdir())  # nothing written, not even a temp file
        assert modelfile.restore(ChainModel(), small / "chain-model.snapshot", store) == set()
        chains(model := ChainModel(), 2_000, 40)  # ~0.3 MB: room enough
        modelfile.save(model, small / "chain-model.snapshot", store, [NS])
        assert modelfile.restore(ChainModel(), small / "chain-model.snapshot", store) == {NS}


def test_a_save_replaces_a_link_at_its_path_not_its_target(tmp_path: Path, store: Store) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"not cachemgr's")
    path = tmp_path / "chain-model.snapshot"
    path.symlink_to(outside)
    modelfile.save(ChainModel(), path, store, [])
    assert outside.read_bytes() == b"not cachemgr's"
    assert not path.is_symlink() and path.read_bytes().startswith(modelfile.MAGIC)


def test_only_namespaces_the_model_held_as_the_index_does_are_restored(
    tmp_path: Path, store: Store
) -> None:
    model = ChainModel()
    chains(model, 100, 10)
    model.add("other", "ab" * 32 + SUFFIX, 64, 1, seq=500, at=0.0)  # (its scan had failed)
    modelfile.save(model, tmp_path / "m", store, [NS])
    assert modelfile.restore(ChainModel(), tmp_path / "m", store) == {NS}  # "other": loaded


def test_a_save_killed_midway_leaves_no_temp_file_for_ever(tmp_path: Path) -> None:
    """A kill -9 during the save at a stop (a supervisor's stop timeout runs out just then)
    leaves write_atomic's temp file, as big as the model, in the state dir on the server's
    filesystem: the next save removes it. Only that: not a symlink of its shape (nor its
    target), not another file's temp, not one young enough to be a save in progress."""
    layout, d = _root(tmp_path)
    with running_daemon(_settings(layout)) as dm:
        _serve(dm, d, 1, 2)
    state = layout.state_dir
    killed = state / f".{layout.model_snapshot.name}.0123456789ab.tmp-cachemgr"
    killed.write_bytes(layout.model_snapshot.read_bytes()[:5000])  # a save cut short
    outside = tmp_path / "outside"
    outside.write_bytes(b"not cachemgr's")
    link = state / f".{layout.model_snapshot.name}.ba9876543210.tmp-cachemgr"
    link.symlink_to(outside)
    other = state / ".state.db.0123456789ab.tmp-cachemgr"
    other.write_bytes(b"x")
    young = state / f".{layout.model_snapshot.name}.00000000000a.tmp-cachemgr"
    young.write_bytes(b"x")
    hour_ago = os.stat(killed).st_mtime - 3600
    for p in (killed, other):
        os.utime(p, (hour_ago, hour_ago))
    os.utime(link, (hour_ago, hour_ago), follow_symlinks=False)
    with running_daemon(_settings(layout)) as dm:
        _serve(dm, d, 3, 1)
    assert not killed.exists()
    assert link.is_symlink() and outside.read_bytes() == b"not cachemgr's"
    assert other.exists() and young.exists()
    with sqlite3.connect(layout.db_path) as conn:  # and the snapshot was saved (stamped)
        assert conn.execute("SELECT count(*) FROM model_stamp").fetchone() == (1,)
