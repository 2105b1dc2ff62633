"""The daemon's chain model saved next to the DB when it stops, and loaded when it starts.

Loading the model from the index is one pass over every row (seconds at a million pages), and
it loses what only the model knew: the eviction order's segments (the first order after it
walks every page), the learner's banked votes, the memory of evicted pages (cachemgr.gc.history)
and which eviction order won (cachemgr.gc.adapt). So a daemon that stops cleanly writes its
model's arrays to `<state dir>/chain-model.snapshot` (one file, written atomically), then puts
the file's random token in the index (`model_stamp`, migration 0008). The next start uses the
file only when all of these hold, else it loads from the index as before:

* the index still holds that token: triggers delete it on any change to `pages` (a CLI scan,
  GC or purge, another daemon), and the daemon takes it when it starts, so after a kill -9 or
  a run that changed the index there is none;
* the file says the same token, this code's format version (6: a path's key packed with its
  shape; a file of an older version is not read, the index is: once, after an upgrade)
  and this machine's array layout;
* its CRC-32 (of all of it) checks, every array has the length the header gives, and the key
  table is at most three quarters full (counted in the table, not only said in the header): a
  truncated or garbled file is refused, not trusted.

Namespaces whose files changed on disk while the daemon was down are loaded again from the
index after the start-up scan (cachemgr.daemon.indexer), like today.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import shutil
import sqlite3
import struct
import sys
import zlib
from array import array
from collections.abc import Iterable, Iterator
from io import BufferedReader
from pathlib import Path
from typing import Any

from cachemgr.errors import CachemgrError
from cachemgr.fs.atomic import write_atomic
from cachemgr.fs.deletecheck import Names
from cachemgr.fs.deletion import sweep_own_temps
from cachemgr.fs.safe import is_own_temp, open_file
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.keyfile import CHUNK, KEY_BYTES
from cachemgr.gc.keyshape import sound
from cachemgr.gc.pagestore import COLUMNS, FULL, NARROW, NONE, WIDER, PageStore
from cachemgr.state import pages_sql
from cachemgr.state.index import ScanChanges
from cachemgr.state.store import Store

log = logging.getLogger(__name__)
MAGIC = b"cachemgr-chain-model\n"
# 2: the memory of evicted pages and the adaptive order's state; 3: each column's item type in
# the header (the count columns widen as their values grow); 4: the access sequences' columns
# narrow too (32 bits until a sequence outgrows them); 5: the keys' fingerprints, by which the
# key table finds them (the keys are on disk: cachemgr.gc.keyfile); 6: a path's key packed
# with its shape (a vLLM block's, kept whole in the header before: 1.9 GB at 10M blocks).
VERSION = 6
_SHAPE_CODES = ("B", "H", "i", "q")  # a key shape column's item types, narrowest first
_LEN = struct.Struct("<Q")  # the header's length, after the magic
_CRC = struct.Struct("<I")  # the CRC-32 of everything before it, at the end
_SEGMENTS = (("leaf", "i"), ("top", "i"), ("last", "q"), ("when", "d"))
ROOM = 4  # times the file's size that must be free to write it: it never takes the disk's last
STALE_TEMP = 600.0  # seconds unchanged after which a temp file of the model is a dead save's


class SnapshotInvalid(ValueError):
    """The file is not a snapshot this code wrote of this index."""


def _layout() -> dict[str, Any]:
    """What the raw arrays depend on besides the format: byte order and item sizes."""
    return {"order": sys.byteorder, "sizes": {c: array(c).itemsize for c in "bBhHiIqd"}}


def _typecodes(h: dict[str, Any]) -> dict[str, str]:
    """The saved columns' item types, as the header gives them (checked: each one a type this
    code gives that column, of the size this machine has)."""
    fresh = PageStore()
    codes: dict[str, str] = h["columns"]
    for c in COLUMNS:
        ok = [getattr(fresh, c).typecode]
        while ok[-1] in WIDER and c in NARROW:
            ok.append(WIDER[ok[-1]])
        if codes[c] not in ok or h["sizes"].get(codes[c]) != array(codes[c]).itemsize:
            raise SnapshotInvalid(f"column {c}: item type {codes[c]!r}")
    return {c: codes[c] for c in COLUMNS}


def save(model: ChainModel, path: Path, store: Store, exact: Iterable[str]) -> None:
    """Write the model to `path` and stamp the index with the file's token (a failure is logged:
    the next start loads the index). The caller makes sure the model is the index's for the
    namespaces `exact`: every event applied, nothing else changing either (GC stopped)."""
    token = secrets.token_hex(16)
    try:
        # The index's write lock from before the model is read until the stamp is in: no
        # other process changes `pages` in between (a change after the stamp takes it away).
        with store.transaction() as conn, model.lock:
            head, body = _encode(model, token, sorted(exact))
            try:
                _sweep_temps(path)
                size = sum(part.nbytes for part in (head, *body)) + model.store.top * KEY_BYTES
                if shutil.disk_usage(path.parent).free < ROOM * size:  # (the server writes there)
                    raise OSError(errno.ENOSPC, f"less than {ROOM}x its {size} bytes free")
                keys = model.store.keys.chunks(model.store.top)
                write_atomic(path, _with_crc(head, keys, body), mode=0o600)
            finally:
                for part in (head, *body):
                    part.release()  # (a column with a view on it could not grow)
            pages_sql.set_model_stamp(conn, token)
    except (sqlite3.Error, OSError, CachemgrError) as e:  # the next start loads the index
        log.warning("chain model not saved", extra={"path": str(path), "error": str(e)})
        return
    log.info("chain model saved", extra={"pages": model.store.count, "path": str(path)})


def _sweep_temps(path: Path) -> None:
    """Delete the temp files of saves killed midway (a supervisor's stop timeout runs out
    while the model is written): each is as big as the model, and nothing else removes them
    from the state dir. Only this file's, only regular files, only old ones (one changed
    lately may be a save in progress of a daemon of another machine on the same state dir)."""
    prefix = f".{path.name}."
    kind: Names = (lambda n: n.startswith(prefix) and is_own_temp(n), "a chain model temp file")
    try:
        r = sweep_own_temps(path.parent, kind, older_than=STALE_TEMP)
        if r.files:
            log.info(
                "chain model temp files of killed saves deleted",
                extra={"files": r.files, "bytes": r.bytes},
            )
    except (OSError, CachemgrError) as e:  # (the save goes on: the write says if it can)
        log.warning("chain model temp files not removed", extra={"error": str(e)})


def _with_crc(
    head: memoryview, keys: Iterator[bytes], body: list[memoryview]
) -> Iterator[memoryview]:
    """The file's parts in order (the keys read from their file as they are written: not held
    in memory all at once), then the CRC-32 of them all."""
    crc = zlib.crc32(head)
    yield head
    for chunk in keys:
        crc = zlib.crc32(chunk, crc)
        yield memoryview(chunk)
    for part in body:
        crc = zlib.crc32(part, crc)
        yield part
    yield memoryview(_CRC.pack(crc))


def _encode(model: ChainModel, token: str, exact: list[str]) -> tuple[memoryview, list[memoryview]]:
    """The header, and the parts after the keys."""
    st, top = model.store, model.store.top
    adapt_table = model.adapt.table()
    segs = model.segments  # leaf -> (top, latest use, its wall clock)
    seg_cols: list[array[Any]] = [array("i", segs)]
    seg_cols += [array(c, (v[i] for v in segs.values())) for i, (_, c) in enumerate(_SEGMENTS[1:])]
    # Views, not copies, of the columns (they hold room for more slots past `top`).
    body = [
        memoryview(st.fps)[:top],
        memoryview(st.leaf)[:top],
        *(memoryview(getattr(st, c))[:top] for c in COLUMNS),
        memoryview(st.freed),
        memoryview(st.table),
        *(memoryview(c) for c in seg_cols),
        memoryview(array("i", model.dirty)),
        memoryview(adapt_table),
        memoryview(st.shape)[:top],  # (empty until a key of another shape came)
    ]
    header = {
        "version": VERSION,
        "token": token,
        **_layout(),
        "columns": {c: getattr(st, c).typecode for c in COLUMNS},
        "top": top,
        "count": st.count,
        "clock": model.clock,
        "filled": st.filled,
        "freed": len(st.freed),
        "table": len(st.table),
        "segments": len(segs),
        "dirty": len(model.dirty),
        "ns_names": st.ns_names,
        "ns_pages": st.ns_pages,
        "ns_slots": st.ns_slots,
        "free_ns": st.free_ns,
        "suffixes": st.suffixes,
        "file_sets": st.file_sets,
        "odd": sorted(st.odd.items()),
        "shapes": st.shapes,
        "shape": [st.shape.typecode, min(len(st.shape), top)],
        "exact": exact,
        "history": model.history.entries(),
        "adapt": model.adapt.state(),
        "adapt_ints": len(adapt_table),
    }
    raw = json.dumps(header).encode()
    return memoryview(MAGIC + _LEN.pack(len(raw)) + raw), body


def restore(model: ChainModel, path: Path, store: Store) -> set[str]:
    """Replace the model with the snapshot at `path` if it is valid for this index; returns
    the namespaces it holds as the index does (the others: the caller loads them from the
    index). Takes the stamp."""
    with store.transaction() as conn:
        token = pages_sql.take_model_stamp(conn)
    if token is None:
        return set()
    try:
        with open(open_file(path, 0), "rb") as f:  # (O_RDONLY, no symlink followed)
            exact = _read(model, f, token)
    # MemoryError: a length within a file with holes (a sparse file planted or grown there)
    # that no machine holds; the lengths of a file we wrote fit in the memory it came from.
    except (OSError, EOFError, ValueError, KeyError, TypeError, MemoryError, CachemgrError) as e:
        log.warning(
            "chain model snapshot not used; loading from the index",
            extra={"path": str(path), "error": str(e)},
        )
        return set()
    log.info("chain model restored", extra={"pages": model.store.count, "path": str(path)})
    return exact


class _Reader:
    """Reads a snapshot's parts in order, with the CRC of what it read so far."""

    def __init__(self, f: BufferedReader) -> None:
        self.f, self.crc, self.left = f, 0, os.fstat(f.fileno()).st_size

    def _take(self, n: int) -> None:
        """Refuse a length the file cannot hold before allocating it (a garbled header)."""
        if not 0 <= n <= self.left:
            raise SnapshotInvalid("truncated, or a length garbled")
        self.left -= n

    def chunks(self, n: int) -> Iterator[bytes]:
        """The next `n` bytes, CHUNK at a time."""
        self._take(n)
        while n:
            raw = self.f.read(min(CHUNK, n))
            if not raw:
                raise SnapshotInvalid("truncated")
            self.crc = zlib.crc32(raw, self.crc)
            n -= len(raw)
            yield raw

    def bytes(self, n: int) -> bytearray:
        self._take(n)
        raw = bytearray(n)  # (read into: no second copy)
        if self.f.readinto(raw) != n:
            raise SnapshotInvalid("truncated")
        self.crc = zlib.crc32(raw, self.crc)
        return raw

    def array(self, typecode: str, n: int) -> array[Any]:
        self._take(n * array(typecode).itemsize)
        # Read into the array itself: fromfile would read into a bytes object of its size
        # first, and a freed block that big is heap the daemon's RSS keeps.
        out = array(typecode, [0]) * n
        view = memoryview(out).cast("B")
        if self.f.readinto(view) != len(view):
            raise SnapshotInvalid("truncated")
        self.crc = zlib.crc32(view, self.crc)
        view.release()
        return out


def _read(model: ChainModel, f: BufferedReader, token: str) -> set[str]:
    r = _Reader(f)
    if r.bytes(len(MAGIC)) != MAGIC:
        raise SnapshotInvalid("not a chain model snapshot")
    h = json.loads(r.bytes(_LEN.unpack(r.bytes(_LEN.size))[0]))
    sizes = {c: array(c).itemsize for c in h["sizes"]}  # (the types the file names)
    if (h["version"], h["token"], h["order"], h["sizes"]) != (
        VERSION,
        token,
        sys.byteorder,
        sizes,
    ):
        raise SnapshotInvalid("another version, machine or index")
    codes = _typecodes(h)
    top, size = h["top"], h["table"]
    if size < 8 or h["filled"] > FULL * size:  # (probing needs empty buckets)
        raise SnapshotInvalid("bad key table size")
    st = PageStore(model.store.keys.where)
    st.keys.fill(r.chunks(top * KEY_BYTES))
    st.fps, st.leaf = r.array("Q", top), r.bytes(top)
    for c in COLUMNS:
        setattr(st, c, r.array(codes[c], top))
    st.freed, st.table = r.array("i", h["freed"]), r.array("i", size)
    segs = [r.array(c, h["segments"]) for _, c in _SEGMENTS]
    dirty = r.array("i", h["dirty"])
    table = r.array("q", h["adapt_ints"])
    shape_code, shaped = h["shape"]
    if shape_code not in _SHAPE_CODES or shaped not in (0, top):
        raise SnapshotInvalid(f"key shapes: {shape_code!r} for {shaped} slots")
    st.shape = r.array(shape_code, shaped)
    if r.f.read(_CRC.size + 1) != _CRC.pack(r.crc):
        raise SnapshotInvalid("CRC mismatch")
    if size - st.table.count(NONE) != h["filled"]:  # (a full table's probe would never end)
        raise SnapshotInvalid("key table fuller than its header says")
    st.top, st.count, st.filled = top, h["count"], h["filled"]
    st.ns_names, st.ns_pages, st.ns_slots = h["ns_names"], h["ns_pages"], h["ns_slots"]
    st.free_ns, st.suffixes = h["free_ns"], h["suffixes"]
    st.ns_num = {n: i for i, n in enumerate(st.ns_names) if n}
    st.file_sets = [tuple((s, z) for s, z in fs) for fs in h["file_sets"]]
    st.file_ids = {fs: i for i, fs in enumerate(st.file_sets)}
    st.shapes = [(str(before), str(after)) for before, after in h["shapes"]]
    if not sound(st.shapes, st.shape):
        raise SnapshotInvalid("key shapes that cannot name the keys")
    st.shape_ids = {shape: i for i, shape in enumerate(st.shapes)}
    st.fit_numbers()
    st.odd = {int(s): k for s, k in h["odd"]}
    with model.lock:
        model.store.keys.close()
        model.store, model.clock = st, h["clock"]
        model.segments = {k: (t, la, w) for k, t, la, w in zip(*segs, strict=True)}
        model.dirty = set(dirty)
        model.history.restore(h["history"])
        model.adapt.restore(h["adapt"], table)
    return set(h["exact"]) & set(st.ns_num)


def apply_scan(model: ChainModel, ns: str, changes: ScanChanges) -> None:
    """Bring a namespace of a restored model up to date with a start-up scan that changed its
    index (the server wrote or something deleted files while the daemon was down): as a load
    from the index would, without reading every row."""
    new, gone = changes
    model.remove(ns, gone)
    for name, key_len, size, mtime in new:  # (rows a scan adds: never used, no link yet)
        model.add(ns, name, key_len, size, seq=0, at=mtime, born=0)
