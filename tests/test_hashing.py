"""Per-file hashing and the digest cache, on real files."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash
from safetensors.numpy import save_file

from cachemgr.errors import IdentityError
from cachemgr.identity import hashing
from cachemgr.identity.digest_cache import DigestCache
from cachemgr.identity.hashing import FileStat, hash_file, hash_files
from cachemgr.state.store import Store

HOUR_AGO = time.time() - 3600


def write(path: Path, data: bytes, mtime: float = HOUR_AGO) -> Path:
    path.write_bytes(data)
    os.utime(path, (mtime, mtime))
    return path


def test_full_digest_is_xxh3_128_of_the_content(tmp_path: Path) -> None:
    data = os.urandom(hashing.CHUNK * 2 + 12345)  # several chunks and a partial one
    got = hash_file(write(tmp_path / "a.bin", data))
    assert got.digest == xxhash.xxh3_128_hexdigest(data)
    assert got.stat.size == len(data)


def test_a_file_changed_once_while_hashed_is_rehashed(tmp_path: Path) -> None:
    path = write(tmp_path / "shard.safetensors", os.urandom(hashing.CHUNK * 3))
    changes = []

    def writer_strikes(_n: int) -> None:
        # A download still appending: the first pass sees the file grow under it.
        if not changes:
            with open(path, "ab") as f:
                f.write(b"more bytes")
            changes.append(1)

    got = hash_file(path, progress=writer_strikes)
    assert got.digest == xxhash.xxh3_128_hexdigest(path.read_bytes())
    assert got.stat.size == hashing.CHUNK * 3 + len(b"more bytes")


def test_a_file_that_keeps_changing_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path / "shard.safetensors", os.urandom(hashing.CHUNK * 2))

    def always_writing(_n: int) -> None:
        with open(path, "r+b") as f:
            f.write(os.urandom(16))

    with pytest.raises(IdentityError, match="changed while it was being hashed"):
        hash_file(path, progress=always_writing)


def test_a_file_replaced_by_rename_while_hashed_is_rehashed(tmp_path: Path) -> None:
    path = write(tmp_path / "shard.safetensors", os.urandom(hashing.CHUNK * 2))
    new = os.urandom(hashing.CHUNK * 2)
    done = []

    def replace(_n: int) -> None:
        if not done:  # same size, new inode: only the inode tells
            write(tmp_path / "tmp", new)
            os.replace(tmp_path / "tmp", path)
            done.append(1)

    assert hash_file(path, progress=replace).digest == xxhash.xxh3_128_hexdigest(new)


def test_broken_symlink_says_so(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "blobs" / "missing")
    with pytest.raises(IdentityError, match=r"broken symlink .*interrupted download"):
        hash_file(tmp_path / "model.safetensors")


def test_directory_where_a_file_is_expected(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(IdentityError, match="is a directory, not a regular file"):
        hash_file(tmp_path / "model.safetensors")


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(IdentityError, match="special file"):
        hash_file(tmp_path / "model.safetensors")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="does not exist"):
        hash_file(tmp_path / "nope.bin")


def test_unreadable_file_is_a_clear_error(tmp_path: Path) -> None:
    # The tests run as root, for whom chmod 000 changes nothing. /proc/self/mem is a regular
    # file whose read at offset 0 fails with EIO for anyone: a genuinely unreadable file.
    (tmp_path / "model.bin").symlink_to("/proc/self/mem")
    with pytest.raises(IdentityError, match=r"cannot read .*model\.bin: Input/output error"):
        hash_file(tmp_path / "model.bin")


def test_fast_mode_reads_the_safetensors_header(tmp_path: Path) -> None:
    a, b, c = (tmp_path / f"{n}.safetensors" for n in "abc")
    save_file({"w": np.zeros((64, 64), np.float32)}, str(a))
    save_file({"w": np.ones((64, 64), np.float32)}, str(b))  # same header, other values
    save_file({"w": np.zeros((64, 32), np.float32), "v": np.zeros(64, np.float32)}, str(c))
    fast = {p.name: hash_file(p, fast=True).digest for p in (a, b, c)}
    assert fast["a.safetensors"] == fast["b.safetensors"]  # the documented blind spot
    assert fast["a.safetensors"] != fast["c.safetensors"]
    assert hash_file(a).digest != hash_file(b).digest  # a full hash sees the values
    assert hash_file(a, fast=True).digest != hash_file(a).digest


def test_fast_mode_rejects_a_file_that_is_not_safetensors(tmp_path: Path) -> None:
    path = write(tmp_path / "x.safetensors", b"\xff" * 64)
    with pytest.raises(IdentityError, match="not a valid safetensors file"):
        hash_file(path, fast=True)


def test_hash_files_matches_one_by_one(tmp_path: Path) -> None:
    paths = [write(tmp_path / f"s{i}.bin", os.urandom(1000 * i + 1)) for i in range(12)]
    seen: list[int] = []
    together = hash_files(paths, workers=4, progress=seen.append)
    assert {p: h.digest for p, h in together.items()} == {p: hash_file(p).digest for p in paths}
    assert sum(seen) == sum(p.stat().st_size for p in paths)
    assert hash_files([]) == {}


def test_hash_files_raises_the_first_failure(tmp_path: Path) -> None:
    paths = [write(tmp_path / f"s{i}.bin", b"x" * 100) for i in range(4)]
    (tmp_path / "bad.bin").symlink_to(tmp_path / "gone")
    with pytest.raises(IdentityError, match="broken symlink"):
        hash_files([*paths, tmp_path / "bad.bin"])


def test_digest_cache_hits_only_for_the_same_file_version(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    cache = DigestCache(store)
    path = write(tmp_path / "a.bin", b"hello")
    st = hashing.stat_regular(path)
    assert cache.record("xxh3-128", {str(path): (st, "d1")}) == 1
    assert cache.lookup("xxh3-128", {str(path): st}) == {str(path): "d1"}
    assert cache.lookup("fast-v1", {str(path): st}) == {}
    touched = FileStat(st.dev, st.ino, st.size, st.mtime_ns + 1)
    assert cache.lookup("xxh3-128", {str(path): touched}) == {}
    moved = FileStat(st.dev, st.ino + 1, st.size, st.mtime_ns)
    assert cache.lookup("xxh3-128", {str(path): moved}) == {}
    store.close()


def test_digest_cache_does_not_remember_racy_files(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    path = write(tmp_path / "a.bin", b"hello", mtime=time.time())
    st = hashing.stat_regular(path)
    # Hashed in the same instant it was written: a second write in the same mtime tick
    # would go unseen, so the digest is not kept.
    assert DigestCache(store).record("xxh3-128", {str(path): (st, "d1")}) == 0
    later = DigestCache(store, clock=lambda: time.time() + 10)
    assert later.record("xxh3-128", {str(path): (st, "d1")}) == 1
    store.close()


def test_digest_cache_lookup_in_batches(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    cache = DigestCache(store)
    stats = {f"/m/f{i}": FileStat(1, i, i, 1) for i in range(1200)}
    cache.record("xxh3-128", {p: (st, f"d{st.ino}") for p, st in stats.items()})
    hits = cache.lookup("xxh3-128", stats)
    assert len(hits) == 1200 and hits["/m/f7"] == "d7"
    store.close()
