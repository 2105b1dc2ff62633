"""The chain model's page keys live in an unnamed file in the state dir, not in memory
(cachemgr.gc.keyfile): every key reads back as it was given, through runs written at once,
slots reused and a save; a dir the file cannot be made in keeps them in memory, with one
warning; a closed file is never read through a descriptor number reused since."""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import os
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachemgr.gc import keyfile, modelfile
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.keyfile import KEY_BYTES, RUN, KeyFile
from cachemgr.gc.value import eviction_order
from cachemgr.state.store import Store
from tests import test_model_snapshot as snap
from tests.daemon_helpers import running_daemon
from tests.gc_helpers import NS, T0, Tree, evicted, page, policy
from tests.mounts import tmpfs
from tests.polling import wait_for
from tests.test_chain_store import SUFFIX, chains, key


def _raw(i: int) -> bytes:
    return bytes.fromhex(key(i))


def test_keys_read_back_through_runs_reuse_and_single_writes(tmp_path: Path) -> None:
    kf = KeyFile(tmp_path)
    n = 3 * RUN + 17
    for s in range(n):  # (slots in a row: written a run at a time)
        kf.put(s, _raw(s))
    for s in (5, RUN + 1, 2 * RUN + 3):  # slots reused, out of the run's order
        kf.put(s, _raw(10_000 + s))
    kf.put(n, _raw(n))  # (a run again)
    want = {s: _raw(s) for s in range(n + 1)} | {
        s: _raw(10_000 + s) for s in (5, RUN + 1, 2 * RUN + 3)
    }
    assert all(kf.get(s) == raw for s, raw in want.items())
    assert b"".join(kf.chunks(n + 1)) == b"".join(want[s] for s in range(n + 1))
    assert not kf.kept and os.listdir(tmp_path) == []  # (no name in the dir)
    kf.close()


def _held(kf: KeyFile) -> int:
    """How many keys `kf` holds in memory (its file could not take them)."""
    return sum(held.count(1) for _, held in kf.kept.values())


@contextlib.contextmanager
def _full(at: Path, size: str) -> Iterator[Path]:
    """A dir on a tmpfs of `size` filled to its last block (the state dir on a cache disk the
    server filled); its `filler` file, removed, gives the room back."""
    with tmpfs(at, size) as small:
        with open(small / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(bytes(4096))
        yield small


@pytest.fixture
def full_fs(tmp_path: Path) -> Iterator[Path]:
    with _full(tmp_path / "small", "1m") as small:
        yield small


def test_keys_a_full_disk_refuses_cost_what_they_did_in_memory(full_fs: Path) -> None:
    """32 bytes a key and a byte of its block's map (a dict entry and a bytes object each took
    ~150: 1.5 GB at ten million pages); each reads back, through reuse, in a save's chunks,
    and once the disk has room again the file takes new keys and the blocks' keys with them."""
    n = 10 * RUN
    kf = KeyFile(full_fs)
    try:
        tracemalloc.start()
        try:
            for s in range(n):
                kf.put(s, _raw(s))
            # What the key file's code holds, not what another thread of the process (an
            # xdist worker's channel) allocated meanwhile: a CI run counted 65 B a key so.
            held = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(True, keyfile.__file__)]
            )
            used = sum(t.size for t in held.traces)
        finally:
            tracemalloc.stop()
        assert used / n < 40, used / n
        assert _held(kf) == n
        for s in (3, RUN + 7, 5 * RUN):  # reused: kept in place of the key they had
            kf.put(s, _raw(10_000 + s))
        want = {s: _raw(s) for s in range(n)}
        want |= {s: _raw(10_000 + s) for s in (3, RUN + 7, 5 * RUN)}
        assert all(kf.get(s) == raw for s, raw in want.items())
        assert b"".join(kf.chunks(n)) == b"".join(want[s] for s in range(n))
        (full_fs / "filler").unlink()
        for s in range(RUN):  # the first block's slots reused, with room to write them now
            kf.put(s, _raw(20_000 + s))
            want[s] = _raw(20_000 + s)
        kf.put(9 * RUN, _raw(9))  # (another run: the one before is written)
        want[9 * RUN] = _raw(9)
        assert not kf.kept and _held(kf) == 0  # (all moved back at that write: < CHUNK)
        assert all(kf.get(s) == raw for s, raw in want.items())
        assert b"".join(kf.chunks(n)) == b"".join(want[s] for s in range(n))
    finally:
        kf.close()


def test_the_keys_held_in_memory_are_counted_and_go_back_to_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`in_memory` (the daemon's metric, read without the model's lock) counts each key held
    once, reused or not; once the disk has room, the writes that follow move the blocks' keys
    back to the file a bounded part at a time, and the count goes down to 0 with a line."""
    caplog.set_level(logging.INFO, "cachemgr.gc.keyfile")
    n = 20 * RUN  # (more than one write moves back: CHUNK bytes of keys at a time)
    with _full(tmp_path / "small", "4m") as small:
        kf = KeyFile(small)
        try:
            for s in range(n):
                kf.put(s, _raw(s))
            assert kf.in_memory == _held(kf) == n
            for s in (3, RUN + 7):  # reused: held in place of the key they had, not twice
                kf.put(s, _raw(10_000 + s))
            assert kf.in_memory == _held(kf) == n
            (small / "filler").unlink()
            kf.put(n, _raw(n))  # (the write of slot RUN + 7's run succeeds)
            assert 0 < kf.in_memory == _held(kf) < n - RUN
            kf.put(n + 5, _raw(n + 5))  # (the write of slot n's)
            assert kf.in_memory == _held(kf) == 0 and not kf.kept
            want = {s: _raw(s) for s in range(n + 1)} | {
                3: _raw(10_003),
                RUN + 7: _raw(10_000 + RUN + 7),
            }
            assert all(kf.get(s) == raw for s, raw in want.items())
            assert b"".join(kf.chunks(n + 1)) == b"".join(want[s] for s in range(n + 1))
        finally:
            kf.close()
    said = [r.getMessage() for r in caplog.records]
    assert said.count("page keys kept in memory: their file cannot be written") == 1
    assert said.count("page keys back in their file") == 1


def _unnamed_in(where: Path) -> list[str]:
    """This process's open files in `where` that have no name there."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # (the listing's own, closed since)
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
    return [link for link in links if link.startswith(f"{where}/") and "(deleted)" in link]


def test_the_daemon_keeps_its_model_s_keys_in_its_state_dir_unnamed(tmp_path: Path) -> None:
    layout, d = snap._root(tmp_path)
    with running_daemon(snap._settings(layout)) as dm:
        model = snap._serve(dm, d, 1, 12)
        with model.lock:
            assert len(b"".join(model.store.keys.chunks(model.store.top))) > 0  # (writes the run)
            size = os.fstat(model.store.keys._fd()).st_size
            assert size == model.store.top * KEY_BYTES > 0
        assert len(_unnamed_in(layout.state_dir)) == 1
        assert not [n for n in os.listdir(layout.state_dir) if "keys" in n]
    assert not _unnamed_in(layout.state_dir)  # (let go at the stop)


def test_a_dir_the_file_cannot_be_made_in_keeps_the_keys_in_memory(
    tmp_path: Path, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """And a save and a restore (into a model whose file works) keep them all."""
    caplog.set_level(logging.WARNING, "cachemgr.gc.keyfile")
    model = ChainModel(key_dir=tmp_path / "gone")
    chains(model, 3 * RUN, 40)
    assert _held(model.store.keys) >= 2 * RUN
    warned = [r for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(warned) == 1
    want = [v.names for v in eviction_order(model, before=math.inf)]
    assert want[0] and len(want) == 3 * RUN
    path = tmp_path / "chain-model.snapshot"
    modelfile.save(model, path, store, [NS])
    restored = ChainModel(key_dir=tmp_path)
    assert modelfile.restore(restored, path, store) == {NS}
    assert not restored.store.keys.kept
    assert [v.names for v in eviction_order(restored, before=math.inf)] == want
    assert dict(restored.pages) == dict(model.pages)


def test_a_model_closed_at_stop_is_never_saved_with_the_keys_it_let_go(
    tmp_path: Path, store: Store
) -> None:
    """The daemon closes its model's key file at stop; an index thread that outlived its stop
    timeout may still add a page, then save the model: nothing is stamped (the next start
    loads the index), never a file whose keys read as zeros."""
    model = ChainModel(key_dir=tmp_path)
    chains(model, 3 * RUN, 40)
    assert model.close(1)
    model.observe_write(NS, key(10**6) + SUFFIX, 64, seq=10**6, at=1e9)
    path = tmp_path / "chain-model.snapshot"
    modelfile.save(model, path, store, [NS])
    assert modelfile.restore(ChainModel(key_dir=tmp_path), path, store) == set()


def test_a_closed_key_file_is_never_read_through_a_reused_descriptor(tmp_path: Path) -> None:
    kf = KeyFile(tmp_path)
    for s in range(RUN + 1):
        kf.put(s, _raw(s))
    fd = kf._fd()
    kf.close()
    other = os.open(tmp_path, os.O_TMPFILE | os.O_RDWR, 0o600)
    try:
        assert other == fd  # (the lowest number free: the one closed)
        os.pwrite(other, bytes(KEY_BYTES * 4), 0)
        with pytest.raises(OSError, match="closed"):
            kf.get(1)
    finally:
        os.close(other)


def test_victims_are_named_by_their_keys_read_from_the_file(tmp_path: Path) -> None:
    """The order's victims carry each page's whole key and file names, though the model holds
    only fingerprints in memory."""
    model = ChainModel(key_dir=tmp_path)
    chains(model, 2 * RUN + 5, 30)
    victims = list(eviction_order(model, before=math.inf))
    assert {v.key for v in victims} == {key(i) for i in range(2 * RUN + 5)}
    assert all(v.names == (v.key + SUFFIX,) for v in victims)


def _at_the_lock(t: threading.Thread) -> bool:
    """Whether thread `t` is in eviction_order, waiting for the model's lock."""
    lines, first = inspect.getsourcelines(eviction_order)
    at = first + next(i for i, line in enumerate(lines) if "with model.lock:" in line)
    frame = sys._current_frames().get(t.ident or 0)
    while frame is not None and frame.f_code.co_name != "eviction_order":
        frame = frame.f_back
    return frame is not None and frame.f_lineno == at


def test_an_order_that_waited_for_a_restore_names_the_restored_pages(
    tmp_path: Path, store: Store
) -> None:
    """A restore (the state DB replaced by a copy stamped at a clean stop) replaces the store
    and closes its keys' file: an order the GC thread started meanwhile reads the new one."""
    saved, path = snap.saved_model(tmp_path, store)
    model = ChainModel(key_dir=tmp_path)
    chains(model, 2 * RUN, 40)  # (pages before the restore)
    got: list[tuple[str, str]] = []
    order = eviction_order(model, before=math.inf)
    with model.lock:
        gc = threading.Thread(target=lambda: got.extend((v.namespace_id, v.key) for v in order))
        gc.start()
        wait_for(lambda: _at_the_lock(gc), what="the order waiting for the model's lock")
        assert modelfile.restore(model, path, store) == {NS}
    gc.join(30)
    assert got == snap.victims(saved)


def test_a_one_off_gc_run_keeps_its_model_s_keys_beside_the_db(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`cachemgr gc` without a daemon loads a model of its own: its keys go to the state dir,
    as the daemon's, not to $TMPDIR (a container's small /tmp, or RAM on a tmpfs one)."""
    caplog.set_level(logging.WARNING, "cachemgr.gc.keyfile")
    monkeypatch.setattr(tempfile, "tempdir", str(root / "no-such-tmp"))  # ($TMPDIR gone)
    tree = Tree.at(root)
    try:
        tree.write(NS, [page(i) for i in range(3 * RUN)], at=T0, size=10)
        tree.rec.model.close(0)  # (the plan loads its own, as the CLI does)
        caplog.clear()  # (the writer's model, as a test's, kept its keys in memory)
        plan = tree.plan(policy(max_bytes=10 * RUN), now=T0 + 1, model=None)
    finally:
        tree.close()
    assert len(evicted(plan)) >= 2 * RUN
    assert not [r for r in caplog.records if "cannot be written" in r.getMessage()]


def test_a_start_deletes_the_key_files_a_killed_process_left_named_and_only_those(
    tmp_path: Path,
) -> None:
    """Without O_TMPFILE the key file is named between mkstemp and unlink: a kill -9 then left
    it in the state dir for good. A start deletes such files: only regular files of exactly
    that name, in the state dir itself, old enough not to be another machine's in the making;
    never a link's target."""
    layout, _ = snap._root(tmp_path)
    state, old = layout.state_dir, time.time() - 3600
    fd, killed = tempfile.mkstemp(dir=state, prefix=".cachemgr-keys.")  # (as `_unnamed` names)
    os.close(fd)
    outside = tmp_path / "outside"
    outside.write_bytes(b"not cachemgr's")
    (state / ".cachemgr-keys.link1234").symlink_to(outside)
    (state / ".cachemgr-keys.dir45678").mkdir()
    (state / "sub").mkdir()
    kept = [
        state / ".cachemgr-keys.young123",  # (another machine's, made a moment ago)
        state / ".cachemgr-keys.toolong99",
        state / "x.cachemgr-keys.abcdefgh",
        state / "sub" / ".cachemgr-keys.abcdefgh",
    ]
    for path in [Path(killed), *kept[1:]]:
        path.touch()
        os.utime(path, (old, old))
    kept[0].touch()
    os.utime(state / ".cachemgr-keys.link1234", (old, old), follow_symlinks=False)
    os.utime(outside, (old, old))
    with running_daemon(snap._settings(layout)):
        assert not Path(killed).exists()
        assert all(p.is_file() for p in kept)
        assert (state / ".cachemgr-keys.link1234").is_symlink()
        assert outside.read_bytes() == b"not cachemgr's"
        assert (state / ".cachemgr-keys.dir45678").is_dir()
