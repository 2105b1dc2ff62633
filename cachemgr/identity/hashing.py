"""Content digests of model files: chunked xxh3-128, several files at once, change-detecting.

xxhash releases the GIL while it hashes and `readinto` releases it while it reads, so a small
thread pool overlaps the reading of one file with the hashing of another.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import xxhash

from cachemgr.errors import IdentityError

ALGO_FULL = "xxh3-128"
ALGO_FAST = "fast-v1"  # safetensors header (or first+last MiB) + size; never the whole file
CHUNK = 2 << 20  # fits L2+L3 per thread; 1–4 MiB reads peak, 16 MiB is slower (FIELD_NOTES §7)
_FAST_EDGE = 1 << 20
_MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors format caps its JSON header at 100 MB

Progress = Callable[[int], None]


@dataclass(frozen=True)
class FileStat:
    """What identifies one version of a file without reading it."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStat:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class HashedFile:
    """A file's digest and the version of the file it belongs to."""

    stat: FileStat
    digest: str


def stat_regular(path: Path) -> FileStat:
    """Stat `path` through symlinks; anything but a readable regular file is an IdentityError."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            target = os.readlink(path)
            raise IdentityError(
                f"{path} is a broken symlink (to {target}): an interrupted download?"
            ) from None
        raise IdentityError(f"{path} does not exist") from None
    except OSError as e:
        raise IdentityError(f"cannot stat {path}: {e.strerror or e}") from e
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a special file (fifo/socket/device)"
        raise IdentityError(f"{path} is {kind}, not a regular file")
    return FileStat.of(st)


def hash_file(path: Path, *, fast: bool = False, progress: Progress | None = None) -> HashedFile:
    """Digest one file; if it changes while read, retry once, then raise IdentityError."""
    for _ in range(2):
        before = stat_regular(path)
        digest = _hash_once(path, before, fast, progress)
        if digest is not None and stat_regular(path) == before:
            return HashedFile(before, digest)
    raise IdentityError(
        f"{path} changed while it was being hashed, twice; is a download or copy still writing it?"
    )


def _hash_once(path: Path, expect: FileStat, fast: bool, progress: Progress | None) -> str | None:
    """The digest of the file at `path`, or None if it is no longer the file `expect` describes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise IdentityError(f"cannot open {path}: {e.strerror or e}") from e
    try:
        if FileStat.of(os.fstat(fd)) != expect:
            return None
        if fast:
            return _fast_digest(fd, path, expect.size)
        # Readahead hint: the kernel doubles its window for sequential readers.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return _full_digest(fd, expect.size, progress)
    except OSError as e:
        raise IdentityError(f"cannot read {path}: {e.strerror or e}") from e
    finally:
        os.close(fd)


def _full_digest(fd: int, size: int, progress: Progress | None) -> str | None:
    h = xxhash.xxh3_128()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total = 0
    with open(fd, "rb", buffering=0, closefd=False) as f:
        while n := f.readinto(view):
            h.update(view[:n])
            total += n
            if progress is not None:
                progress(n)
    return h.hexdigest() if total == size else None  # grew or shrank under us


def _fast_digest(fd: int, path: Path, size: int) -> str:
    """Header + size: a safetensors file's header names every tensor's dtype, shape and offset."""
    h = xxhash.xxh3_128(size.to_bytes(8, "little"))
    if path.name.endswith(".safetensors"):
        n = int.from_bytes(os.pread(fd, 8, 0), "little")
        if size < 8 or n > _MAX_SAFETENSORS_HEADER or 8 + n > size:
            raise IdentityError(f"{path} is not a valid safetensors file (header length {n})")
        h.update(os.pread(fd, n, 8))
    else:
        h.update(os.pread(fd, _FAST_EDGE, 0))
        h.update(os.pread(fd, _FAST_EDGE, max(0, size - _FAST_EDGE)))
    return h.hexdigest()


def default_workers() -> int:
    """One thread per core plus one to cover I/O waits (measured best on 2 cores, bench/)."""
    return min(8, max(2, (os.cpu_count() or 1) + 1))


def hash_files(
    paths: Sequence[Path],
    *,
    fast: bool = False,
    workers: int = 0,
    progress: Progress | None = None,
) -> dict[Path, HashedFile]:
    """Digest many files in parallel; the first failure cancels the rest and is raised."""
    if not paths:
        return {}
    # Largest first, so one big shard does not start last and run alone.
    order = sorted(paths, key=lambda p: stat_regular(p).size, reverse=True)
    n = min(len(order), workers or default_workers())
    with ThreadPoolExecutor(n, thread_name_prefix="cachemgr-hash") as pool:
        futures = {pool.submit(hash_file, p, fast=fast, progress=progress): p for p in order}
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for fut in done:
            error = fut.exception()
            if error is not None:
                pool.shutdown(cancel_futures=True)
                raise error
        return {futures[fut]: fut.result() for fut in futures}
