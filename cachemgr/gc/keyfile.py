"""The chain model's page keys on disk, 32 bytes a slot, out of the daemon's memory.

A 64-hex-digit key (SGLang's sha256) packed to bytes was 32 of the ~72 bytes a page the model
held in RAM (bench/RESULTS.md). The model finds a key's slot by its 64-bit fingerprint
(cachemgr.gc.pagestore); the key itself is needed only to name a page's files when it is
evicted, to save the model, and for reports: a read of 32 bytes then (~1 µs). So the keys sit
in an unnamed temp file (O_TMPFILE: gone when the process is, even after a kill -9) in the
state dir, at slot × 32, and the kernel's page cache keeps them in memory while it has memory
to spare: reclaimable, not the daemon's.

New slots are mostly handed out in a row (`top`, as a load or a scan adds pages), so their keys
are gathered in a buffer and written 2,048 at a time; a reused slot's key is written at once.
A key that cannot be written (the state dir's disk full, or not writable) is kept in memory
instead, with one warning: in blocks of RUN slots' keys, each with a byte a slot saying whether
its key is held there. A key then costs the 32 bytes it did when every key was in memory (a
dict entry and a bytes object each took ~150: 1.5 GB at ten million keys, on a full disk),
and a save copies each block's keys into the chunk it reads once (not a look at every key
kept for every chunk). How many keys are held so is counted as they come and go
(`in_memory`: the daemon's metric, /v1/status and doctor read it without the model's lock).
Once a write succeeds again, each successful write also moves up to CHUNK bytes of the kept
blocks' keys to the file, so the memory is given back while the model is in use, not only as
slots are reused; the last block's move logs that the keys are back in their file.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path

from cachemgr.errors import CachemgrError
from cachemgr.fs.deletecheck import Names
from cachemgr.fs.deletion import sweep_own_temps

log = logging.getLogger(__name__)
KEY_BYTES = 32  # 64 hex digits
RUN = 2048  # keys of consecutive slots gathered before one write
CHUNK = 1 << 20  # bytes a bulk read or copy moves at a time
_CLOSED = -2
_PREFIX = ".cachemgr-keys."  # `_unnamed`'s name without O_TMPFILE, for an instant
# Those names exactly (tempfile.mkstemp's: the prefix and 8 of [a-z0-9_]), nothing like them.
_LEFTOVER = re.compile(re.escape(_PREFIX) + r"[a-z0-9_]{8}")
LEFTOVERS: Names = (lambda name: _LEFTOVER.fullmatch(name) is not None, "a page key file name")
# Seconds unchanged after which such a file is a killed process's. Its name lives microseconds,
# but a daemon of another machine may share the state dir (NFS has no O_TMPFILE), its clock
# ahead of ours.
STALE_LEFTOVER = 60.0


def _unnamed(where: str) -> int:
    """A new file in dir `where` that has no name (nothing to remove after a kill -9)."""
    try:
        return os.open(where, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as e:  # a filesystem without O_TMPFILE: named for an instant
        if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR):
            raise
    fd, path = tempfile.mkstemp(dir=where, prefix=_PREFIX)
    os.unlink(path)
    return fd


def sweep_leftovers(where: Path) -> None:
    """Delete the key files `_unnamed` left named in dir `where` (a kill -9 between its mkstemp
    and its unlink): nothing else removes them. Only regular files of exactly that name, in
    `where` itself, unchanged for STALE_LEFTOVER seconds; nothing followed."""
    try:
        r = sweep_own_temps(where, LEFTOVERS, older_than=STALE_LEFTOVER)
    except (OSError, CachemgrError) as e:  # (the daemon goes on: a leftover is an empty file)
        log.warning("page key files of killed processes not removed", extra={"error": str(e)})
        return
    if r.files:
        log.info("page key files of killed processes deleted", extra={"files": r.files})
    for why in r.refused:  # (a dir or a link of that name: a person's, said, kept)
        log.warning("page key file name kept", extra={"why": why})


class KeyFile:
    """Slot -> its 32-byte key, in a temp file in `where` (None: the system's temp dir),
    made at the first key. Not thread-safe: the chain model holds its lock."""

    def __init__(self, where: Path | None = None) -> None:
        self.where = where
        self._file = -1  # its descriptor, once made
        self._closer: weakref.finalize[[int], KeyFile] | None = None
        self._run = bytearray()  # keys of slots _start, _start + 1, ... not written yet
        self._start = 0
        # Keys the file could not take: block number -> (its RUN slots' keys, a byte a slot: 1
        # if its key is the one held here).
        self.kept: dict[int, tuple[bytearray, bytearray]] = {}
        # Keys held in `kept` (its bytes set to 1). One int, written under the model's lock,
        # read by any thread without it (a scrape must not wait behind a GC run's order).
        self.in_memory = 0

    def _fd(self) -> int:
        if self._file == _CLOSED:  # (never a read of a descriptor number reused since)
            raise OSError(errno.EBADF, "the page key file is closed")
        if self._file < 0:
            self._file = _unnamed(self._dir())
            self._closer = weakref.finalize(self, os.close, self._file)  # (or at `close`)
        return self._file

    def _dir(self) -> str:
        """Where the file is (to be) made."""
        return str(self.where or tempfile.gettempdir())

    def close(self) -> None:
        """Let the file go (its keys with it); a use after this is an OSError."""
        if self._closer is not None:
            self._closer()
        self._file, self._run, self.kept, self.in_memory = _CLOSED, bytearray(), {}, 0

    def put(self, s: int, raw: bytes) -> None:
        """Keep slot `s`'s key (in place of the one it had)."""
        at = (s - self._start) * KEY_BYTES
        if self._run and 0 <= at <= len(self._run):
            self._run[at : at + KEY_BYTES] = raw  # (the run's next slot, or one of it reused)
            if len(self._run) >= RUN * KEY_BYTES:
                self._flush()
            return
        self._flush()
        self._start, self._run = s, bytearray(raw)

    def _flush(self) -> None:
        if not self._run:
            return
        run, start, self._run = self._run, self._start, bytearray()
        try:
            self._write(run, start * KEY_BYTES)
        except OSError as e:
            if not self.kept:
                log.warning(
                    "page keys kept in memory: their file cannot be written",
                    extra={"dir": self._dir(), "error": str(e)},
                )
            for b, lo, hi in _blocks(start, start + len(run) // KEY_BYTES):
                block = self.kept.get(b)
                if block is None:
                    block = self.kept[b] = (bytearray(RUN * KEY_BYTES), bytearray(RUN))
                keys, held = block
                i = (b * RUN + lo - start) * KEY_BYTES
                keys[lo * KEY_BYTES : hi * KEY_BYTES] = run[i : i + (hi - lo) * KEY_BYTES]
                self.in_memory += hi - lo - held.count(1, lo, hi)
                held[lo:hi] = b"\x01" * (hi - lo)
            return
        if self.kept:  # (the file holds these slots' keys now, not the blocks)
            for b, lo, hi in _blocks(start, start + len(run) // KEY_BYTES):
                block = self.kept.get(b)
                if block is not None:
                    self.in_memory -= block[1].count(1, lo, hi)
                    block[1][lo:hi] = bytes(hi - lo)
                    if block[1].find(1) < 0:
                        del self.kept[b]
            self._give_back()

    def _write(self, data: bytes | bytearray, at: int) -> None:
        """`data` into the file from offset `at`, all of it (an OSError: not all)."""
        fd, view = self._fd(), memoryview(data)
        while view:
            n = os.pwrite(fd, view, at)
            view, at = view[n:], at + n

    def _give_back(self) -> None:
        """Move kept blocks' keys to the file (it took a write again), up to CHUNK bytes of
        them: a little at each write, not a pause of the model's lock for all of them."""
        moved = 0
        while self.kept and moved < CHUNK:
            b = next(iter(self.kept))
            keys, held = self.kept[b]
            try:
                i = held.find(1)
                while i >= 0:  # (each span of keys held here, in one write)
                    j = held.find(0, i)
                    j = RUN if j < 0 else j
                    self._write(keys[i * KEY_BYTES : j * KEY_BYTES], (b * RUN + i) * KEY_BYTES)
                    moved += (j - i) * KEY_BYTES
                    i = held.find(1, j)
            except OSError:  # (full again: the next write that succeeds tries again)
                return
            self.in_memory -= held.count(1)
            del self.kept[b]
        if not self.kept:
            log.info("page keys back in their file", extra={"dir": self._dir()})

    def get(self, s: int) -> bytes:
        """Slot `s`'s key (one it was given)."""
        at = (s - self._start) * KEY_BYTES
        if 0 <= at < len(self._run):
            return bytes(self._run[at : at + KEY_BYTES])
        if self.kept:
            b, i = divmod(s, RUN)
            block = self.kept.get(b)
            if block is not None and block[1][i]:
                return bytes(block[0][i * KEY_BYTES : (i + 1) * KEY_BYTES])
        raw = os.pread(self._fd(), KEY_BYTES, s * KEY_BYTES)
        if len(raw) != KEY_BYTES:
            raise OSError(f"page key file short at slot {s}")
        return raw

    def chunks(self, top: int) -> Iterator[bytes]:
        """The keys of slots 0 .. top - 1 in order, CHUNK bytes at a time (a slot never given
        a key reads as zeros)."""
        self._flush()
        end, at = top * KEY_BYTES, 0
        fd = self._fd() if not self.kept else self._fd_if_any()
        while at < end:
            want = min(CHUNK, end - at)
            raw = os.pread(fd, want, at) if fd >= 0 else b""
            raw += bytes(want - len(raw))  # (past the file's end: zeros)
            if self.kept:
                raw = self._patch(raw, at)
            yield raw
            at += want

    def _fd_if_any(self) -> int:
        """The file's descriptor, or -1 if it was never made and cannot be now (every key is
        kept). A closed file is an OSError: its keys are gone, not kept (a thread that outlived
        the daemon's stop may add a key, then save the model: zeros for them, saved and
        stamped, named every page of the next start's model 000…0)."""
        if self._file != -1:
            return self._fd()
        try:
            return self._fd()
        except OSError:
            return -1

    def _patch(self, raw: bytes, at: int) -> bytes:
        """`raw` (the file's bytes from offset `at`) with the keys kept in memory put in."""
        out = bytearray(raw)
        first = at // KEY_BYTES
        for b, lo, hi in _blocks(first, first + len(raw) // KEY_BYTES):
            block = self.kept.get(b)
            if block is None:
                continue
            keys, held = block
            i = held.find(1, lo, hi)
            while i >= 0:  # (each span of keys held here, in one copy)
                j = held.find(0, i, hi)
                j = hi if j < 0 else j
                to = (b * RUN + i - first) * KEY_BYTES
                out[to : to + (j - i) * KEY_BYTES] = keys[i * KEY_BYTES : j * KEY_BYTES]
                i = held.find(1, j, hi)
        return bytes(out)

    def fill(self, chunks: Iterator[bytes | bytearray]) -> None:
        """Take the keys of slots 0, 1, ... from `chunks`, in order (a saved model's)."""
        at = 0
        for chunk in chunks:
            for i in range(0, len(chunk), RUN * KEY_BYTES):
                part = chunk[i : i + RUN * KEY_BYTES]
                self._start, self._run = at // KEY_BYTES, bytearray(part)
                self._flush()
                at += len(part)


def _blocks(start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """The blocks of RUN slots that slots start .. end - 1 fall in, as (block number, the
    first and past the last of those slots within it)."""
    s = start
    while s < end:
        b = s // RUN
        hi = min(end - b * RUN, RUN)
        yield b, s - b * RUN, hi
        s = b * RUN + hi
