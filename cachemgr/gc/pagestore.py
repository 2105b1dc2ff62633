"""The chain model's pages as integer slots in parallel typed arrays: no Python object per page.

A dict of page objects cost 700-800 bytes a page (a million pages: ~800 MB); here a page is
one slot in eleven `array`s, found through an open-addressing table of slot numbers (4 bytes a
bucket, 1.3 to 2.3 buckets a page) by its key's 64-bit fingerprint: ~44 bytes a page at any
size (bench/RESULTS.md has where they go). The key itself (a 64-hex-digit key, SGLang's
sha256, packed to 32 bytes) is on disk (cachemgr.gc.keyfile), read only to name an evicted
page's files. A key with such a run inside it (a nested page's key is its path: vLLM's
`<folder>_r0/<h[:3]>/<h[3:5]>_g0/<h>.bin`) is packed too, and the rest of it, its *shape*,
numbered: a namespace's millions of such keys have a handful (cachemgr.gc.keyshape). Keys of
another shape (shorter or uppercase hex) are kept as strings on the side, and the few pages'
pending votes in a table of their own (cachemgr.gc.votes).

Two keys of one namespace with the same fingerprint would be taken for one page: among ten
million pages, a chance of about 3 in a million (n² / 2⁶⁵). Its cost is a page the model does
not order (its files stay indexed; a purge or a drop of the namespace takes them), never a
file deleted that is not a page.

A slot is either a page on disk (`files[s] >= 0`, the id of its interned (suffix, size) files)
or a *ghost* (`files[s] == GHOST`): a key that pages on disk still name as their predecessor.
A ghost lives while it has children (`kids[s] > 0`); then its slot is reused.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from array import array
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from cachemgr.gc.keyfile import KeyFile
from cachemgr.gc.keyshape import PLAIN, Packed, Shape, key_fingerprint, pack, unpack
from cachemgr.gc.votes import Votes

GHOST = -1  # files id of a slot that is not a page on disk
NONE = -1  # no slot (no predecessor, empty bucket)
_DEAD = -2  # a bucket whose slot was freed (probing goes on past it)
GROW = 1024  # slots the columns grow by at a time
# The key table is made 1.5 buckets a slot in use and grows past three quarters full: linear
# probing's misses take ~8 probes at worst then, a hit ~2.5.
SPREAD = 1.5
FULL = 0.75
# Columns of counts (of namespaces, file sets, stream suffixes, children, reads) start narrow
# and are widened, the whole column at once, when a value outgrows their items: most of them
# count the few shapes of a namespace's names, not its pages. So do the access sequences: 32
# bits hold the index's first 4.3 billion accesses (~18 h at full speed, months at a server's
# usual rates), then they take 64.
WIDER = {"b": "h", "B": "H", "h": "i", "H": "i", "i": "q", "I": "q"}
_MAX = {c: (1 << 8 * array(c).itemsize - c.islower()) - 1 for c in "bBhHiIq"}
_MIN = {c: -(_MAX[c] + 1) if c.islower() else 0 for c in _MAX}
COUNTS = {"ns": "B", "reads": "H", "files": "b", "kids": "H"}  # (at their narrowest)
SEQS = {"born": "I", "last": "I"}
NARROW = COUNTS | SEQS  # the columns that widen, at their narrowest
# A slot's columns (one typecode each), in the order the model file has them (gc/modelfile.py;
# it keeps no votes: their hashes are salted per process).
COLUMNS = (
    "ns",
    "pred",
    "born",
    "last",
    "time",
    "reads",
    "conf",
    "files",
    "kids",
    "kidx",
)
Files = tuple[tuple[str, int], ...]  # (name after the key, size) of each file of a page
PageId = tuple[str, str]  # (namespace id, page key)


@functools.cache
def _fill(typecode: str, value: int) -> array[Any]:
    """GROW items of `value`: what a column grows by."""
    return array(typecode, [value]) * GROW


class Page(NamedTuple):
    """What the model knows of one logical page (all its files), in access seqs: a copy."""

    pred: str | None  # key of the page before it in its chain (same namespace)
    born: int  # access sequence of its first write (or of when the index first saw it)
    last: int  # access sequence of its latest read or write
    last_time: float  # wall-clock time of that access (only for min_age)
    reads: int
    conf: int  # agreeing reads banked for `pred`
    files: Files  # (name after the key, size) of each file

    @property
    def size(self) -> int:
        return sum(size for _, size in self.files)

    def names(self, key: str) -> tuple[str, ...]:
        return file_names(key, self.files)


def file_names(key: str, files: Files) -> tuple[str, ...]:
    """The names of a page's files, sorted."""
    if len(files) == 1:  # (most pages: one rank's one file)
        return (key + files[0][0],)
    return tuple(sorted(key + suffix for suffix, _ in files))


class PageStore:
    """Slots, their columns, the key → slot table and the set of leaves (pages on disk that
    no page on disk continues). Not thread-safe: the chain model holds its lock."""

    def __init__(self, key_dir: Path | None = None) -> None:
        self.keys = KeyFile(key_dir)  # the packed keys, on disk
        self.fps = array("Q")  # the fingerprint of its key (_fingerprint)
        self.odd: dict[int, str] = {}  # slot -> key, for keys `_pack` cannot pack
        self.ns = array(COUNTS["ns"])  # namespace number (self.ns_names; numbers are reused)
        self.pred = array("i")  # slot of the page before it in its chain, or NONE
        self.born = array(SEQS["born"])  # access sequence of its first write
        self.last = array(SEQS["last"])  # access sequence of its latest use
        # The wall-clock second of that use, rounded up (4 bytes, not a double's 8: a page
        # then looks as young as it is or up to a second younger to min_age and `in_flight`,
        # never older); until 2106.
        self.time = array("I")
        self.reads = array(COUNTS["reads"])
        self.conf = array("b")  # agreeing reads banked for `pred`
        # The predecessor the last contrary read named, as the hash of its key (only compared:
        # a 64-bit collision is the one way this differs from keeping the key itself), and its
        # stream's suffix number, for the few pages on disk that hold one.
        self.votes = Votes()
        self.files = array(COUNTS["files"])  # id of its interned files, or GHOST
        self.kids = array(COUNTS["kids"])  # children on disk
        self.kidx = array("i")  # XOR of their slots: the child itself when there is one
        # Its key's shape number (0: PLAIN, or odd). Empty until the first key of another
        # shape (a vLLM block's): a byte a slot that an SGLang-only model does not pay.
        self.shape = array("B")
        self.shapes: list[Shape] = [PLAIN]  # the shapes of packed keys, numbered as they come
        self.shape_ids: dict[Shape, int] = {PLAIN: 0}
        self.leaf = bytearray()  # 1 for a leaf
        self.ns_names: list[str] = []
        self.ns_num: dict[str, int] = {}
        self.ns_pages: list[int] = []  # pages on disk per namespace number
        self.ns_slots: list[int] = []  # slots (pages and ghosts) per namespace number
        self.free_ns: list[int] = []  # numbers of namespaces forgotten, to reuse
        self.suffixes: dict[str, int] = {}  # stream suffix -> its number
        self.file_sets: list[Files] = []
        self.file_ids: dict[Files, int] = {}
        self.freed = array("i")  # released slots, to reuse
        self.top = 0  # slots handed out (the columns may hold more, for the next ones)
        self.table = array("i", [NONE]) * 8
        self.filled = 0  # buckets not empty (live or dead)
        self.count = 0  # pages on disk

    def clear(self) -> None:
        """Hold no slot, as a new store: those who hold this one see it emptied."""
        self.keys.close()
        self.__dict__.update(PageStore(self.keys.where).__dict__)

    # -- keys -----------------------------------------------------------------------------------

    def key(self, s: int) -> str:
        """The slot's key (a read of the key file: not for each event)."""
        odd = self.odd.get(s) if self.odd else None
        if odd is not None:
            return odd
        digits, shape = self.keys.get(s).hex(), self._shape_of(s)
        return digits if not shape else unpack(digits, self.shapes[shape])

    def _shape_of(self, s: int) -> int:
        """Slot `s`'s key shape number (0 while no key of another shape came: no column)."""
        return self.shape[s] if self.shape else 0

    def digest(self, s: int) -> int:
        """32 bits of the slot's key's fingerprint, the same in every process
        (cachemgr.gc.adapt's tags)."""
        return self.fps[s] >> 32

    def same(self, s: int, key: str) -> bool:
        """Whether slot `s` holds `key` (by its fingerprint: no read of the key file)."""
        packed = pack(key)
        fp = key_fingerprint(packed, key)
        return s >= 0 and self.fps[s] == fp and self._shaped(s, packed, key)

    def _shaped(self, s: int, packed: Packed | None, key: str) -> bool:
        """Whether slot `s`'s key has `key`'s shape: packed with its shape (`packed`), or this
        odd string (a fingerprint is of the packed bytes or of the text: the two never meet)."""
        odd = self.odd
        if packed is None:
            return odd.get(s) == key
        return self._shape_of(s) == self.shape_ids.get(packed[1], -1) and (not odd or s not in odd)

    def find(self, ns: str, key: str) -> int:
        """The slot of (ns, key), or NONE."""
        n = self.ns_num.get(ns)
        return NONE if n is None else self._probe(n, key)[0]

    def _probe(self, n: int, key: str) -> tuple[int, int, Packed | None, int]:
        """(the slot of `key` in namespace `n`, or NONE; if NONE, the bucket to put it in;
        the key packed; its fingerprint)."""
        packed = pack(key)
        fp = key_fingerprint(packed, key)
        table, size, ns, fps, odd = self.table, len(self.table), self.ns, self.fps, self.odd
        shape = 0 if packed is None else self.shape_ids.get(packed[1], -1)
        shapes = self.shape
        i = (fp + n) % size
        free = NONE
        while (s := table[i]) != NONE:
            if s < 0:
                free = i if free == NONE else free
            elif (
                fps[s] == fp
                and ns[s] == n
                and (
                    odd.get(s) == key
                    if packed is None
                    else (shapes[s] if shapes else 0) == shape and (not odd or s not in odd)
                )
            ):  # (_shaped, inline: a call a probe costs more than the rest of it)
                return s, i, packed, fp
            i = (i + 1) % size
        return NONE, i if free == NONE else free, packed, fp

    def ensure(self, ns: str, key: str) -> int:
        """The slot of (ns, key): a new ghost if it has none."""
        n = self.ns_num.get(ns)
        if n is None:
            n = self.ns_num[ns] = self.free_ns.pop() if self.free_ns else len(self.ns_names)
            if n == len(self.ns_names):
                self.ns_names.append(ns)
                self.ns_pages.append(0)
                self.ns_slots.append(0)
                self.fit("ns", n)
            self.ns_names[n] = ns
        if self.filled + 1 > FULL * len(self.table):
            self.reserve(self.top // 2)  # (0.44 full then: it grows with the pages)
        s, i, packed, fp = self._probe(n, key)
        if s == NONE:
            s = self._new_slot(n, packed, key, fp)
            self.filled += self.table[i] == NONE
            self.table[i] = s
        return s

    def _new_slot(self, n: int, packed: Packed | None, key: str, fp: int) -> int:
        if self.freed:
            s = self.freed.pop()
            self.kids[s] = self.kidx[s] = 0
            self.files[s], self.leaf[s] = GHOST, 0
        else:
            if self.top == len(self.ns):
                self._grow()
            s = self.top
            self.top += 1
        self.ns[s] = n
        self.ns_slots[n] += 1
        self.fps[s] = fp
        shape = 0
        if packed is None:
            self.odd[s] = key
        else:
            self.keys.put(s, packed[0])
            shape = self._shape_number(packed[1])
        if shape and not self.shape:
            self.shape = array("B", bytes(len(self.ns)))  # (the first key of another shape)
        if self.shape:
            self.put("shape", s, shape)
        return s

    def _shape_number(self, shape: Shape) -> int:
        """The number of a key shape (numbered as they come: a namespace has a handful)."""
        number = self.shape_ids.get(shape)
        if number is None:
            number = self.shape_ids[shape] = len(self.shapes)
            self.shapes.append(shape)
        return number

    def _grow(self) -> None:
        """Room for GROW more slots in every column, filled as a new ghost's: one call a column
        per GROW pages, not one per page (and no temporary the size of a column: freeing one
        that big makes malloc keep the next ones in its heap, where they fragment)."""
        self.fps.extend(_fill("Q", 0))
        self.leaf += bytes(GROW)
        for col in (self.pred, self.files):
            col.extend(_fill(col.typecode, NONE))
        for col in (
            self.ns,
            self.born,
            self.last,
            self.reads,
            self.conf,
            self.kids,
            self.kidx,
        ):
            col.extend(_fill(col.typecode, 0))
        if self.shape:
            self.shape.extend(_fill(self.shape.typecode, 0))
        self.time.extend(_fill("I", 0))

    # -- column widths --------------------------------------------------------------------------

    def fit(self, col: str, value: int) -> None:
        """Widen column `col` (one of NARROW) until `value` fits its items."""
        c = getattr(self, col)
        code = c.typecode
        while not _MIN[code] <= value <= _MAX[code]:
            code = WIDER[code]
        if code != c.typecode:
            setattr(self, col, array(code, iter(c)))  # (not from `c`: an array of another kind)

    def put(self, col: str, s: int, value: int) -> None:
        """Set slot `s`'s value in column `col` (one of NARROW), widening it if it outgrows it."""
        try:
            getattr(self, col)[s] = value
        except OverflowError:
            self.fit(col, value)
            getattr(self, col)[s] = value

    def fit_numbers(self) -> None:
        """Widen the columns of namespace, file-set and key-shape numbers to hold every number
        handed out (a loaded store's columns fit only the numbers its slots hold)."""
        self.fit("ns", len(self.ns_names) - 1)
        self.fit("files", len(self.file_sets) - 1)
        self.fit("shape", len(self.shapes) - 1)

    def suffix(self, sfx: str) -> int:
        """The number of a stream's file suffix (numbered as they come)."""
        return self.suffixes.setdefault(sfx, len(self.suffixes))

    def _bucket(self, s: int) -> int:
        """The first bucket slot `s` may sit in."""
        return (self.fps[s] + self.ns[s]) % len(self.table)

    def _place(self, s: int) -> None:
        table, size, i = self.table, len(self.table), self._bucket(s)
        while table[i] >= 0:
            i = (i + 1) % size
        self.filled += table[i] == NONE
        table[i] = s

    def reserve(self, more: int) -> None:
        """A new table, two thirds full with every slot in use and `more` (its dead buckets
        go), so that it does not grow and rehash as they come. Any length (not a power of two:
        a table that doubles past a million pages holds 2-4 buckets a page, not 1.5)."""
        live = self.top - len(self.freed) + 1 + more
        self.table = array("i", [NONE]) * max(8, int(SPREAD * live))
        self.filled = 0
        free = set(self.freed)
        for s in range(self.top):
            if s not in free:
                self._place(s)

    def release(self, s: int) -> None:
        """Free a ghost's slot (it has no children left)."""
        table, size, i = self.table, len(self.table), self._bucket(s)
        self.odd.pop(s, None)
        while table[i] != s:
            i = (i + 1) % size
        table[i] = _DEAD
        self.pred[s] = NONE
        self.freed.append(s)
        self.ns_slots[self.ns[s]] -= 1

    def drop_ns(self, ns: str) -> None:
        """Free every slot, page or ghost, of a namespace (its dir is gone) and give its
        number back: one sweep of the table, not a probe of it per key (1.5 µs a slot: a
        10M-page namespace held the chain model's lock for ~15 s). Links never cross
        namespaces, so no other slot's children change."""
        n = self.ns_num[ns]
        table, ns_col, dead = self.table, self.ns, array("i")
        for i, s in enumerate(table):
            if s >= 0 and ns_col[s] == n:
                table[i] = _DEAD
                dead.append(s)
        files, pred, leaf, odd = self.files, self.pred, self.leaf, self.odd
        pages = 0
        for s in dead:
            if files[s] != GHOST:
                files[s] = GHOST
                pages += 1
            pred[s] = NONE
            leaf[s] = 0
            if odd:
                odd.pop(s, None)
        self.freed.extend(dead)
        self.votes.drop_if(lambda s: ns_col[s] == n)
        self.count -= pages
        self.ns_pages[n] -= pages
        self.ns_slots[n] -= len(dead)
        self.forget_ns(ns)

    def forget_ns(self, ns: str) -> None:
        """Give a namespace's number back once it holds no slot (its pages are forgotten)."""
        n = self.ns_num.get(ns)
        if n is not None and not self.ns_slots[n]:
            del self.ns_num[ns]
            self.ns_names[n] = ""
            self.free_ns.append(n)

    # -- pages ----------------------------------------------------------------------------------

    def start(self, s: int, born: int, seq: int, at: float) -> None:
        """Make a ghost a page on disk, with no file yet and no link (kids stay)."""
        self.put("born", s, born)
        self.used(s, seq, at)
        self.pred[s], self.reads[s], self.conf[s] = NONE, 0, 0  # (a ghost holds no vote)
        self.files[s] = self.file_set(())
        self.count += 1
        self.ns_pages[self.ns[s]] += 1

    def used(self, s: int, seq: int, at: float) -> None:
        """Slot `s` was last used at access `seq`, at wall-clock time `at`."""
        try:
            self.last[s] = seq
        except OverflowError:
            self.put("last", s, seq)
        try:
            self.time[s] = math.ceil(at)
        except OverflowError:  # (before 1970 or after 2106: a clock or an mtime set wrong)
            self.time[s] = min(max(math.ceil(at), 0), _MAX["I"])

    def present(self, s: int) -> bool:
        return s >= 0 and self.files[s] != GHOST

    def below_gap(self, s: int) -> bool:
        """Whether `s` is behind a gap: its predecessor is known and gone (nothing below a
        missing page can be loaded)."""
        up = self.pred[s]
        return up != NONE and self.files[up] == GHOST

    def file_set(self, files: Files) -> int:
        """The id of this interned set of files (a namespace has a handful of them)."""
        fid = self.file_ids.get(files)
        if fid is None:
            fid = self.file_ids[files] = len(self.file_sets)
            self.file_sets.append(files)
            self.fit("files", fid)
        return fid

    def pred_key(self, s: int, hint: str | None = None) -> str | None:
        """The key of the page before `s`: `hint` if it is that key (no read of the key file)."""
        p = self.pred[s]
        if p == NONE:
            return None
        return hint if hint is not None and self.same(p, hint) else self.key(p)

    def page(self, s: int) -> Page:
        return Page(
            self.pred_key(s),
            self.born[s],
            self.last[s],
            self.time[s],
            self.reads[s],
            self.conf[s],
            self.file_sets[self.files[s]],
        )

    def size(self, s: int) -> int:
        return sum(size for _, size in self.file_sets[self.files[s]])

    def names(self, s: int, key: str | None = None) -> tuple[str, ...]:
        """The names of the page's files (`key`: its key, if the caller read it already)."""
        # (not by `page`, which reads every column: an eviction asks this of each page)
        return file_names(self.key(s) if key is None else key, self.file_sets[self.files[s]])

    def add_leaf(self, s: int) -> None:
        self.leaf[s] = 1

    def drop_leaf(self, s: int) -> None:
        self.leaf[s] = 0

    def slots(self, ns: str) -> Iterator[int]:
        """Every page on disk of a namespace."""
        n = self.ns_num.get(ns)
        if n is None or not self.ns_pages[n]:
            return
        files = self.files
        for s in self._numbered(n):
            if files[s] != GHOST:
                yield s

    def _numbered(self, n: int) -> Iterator[int]:
        """The slots whose namespace number is `n` (freed ones may be among them), found by
        bytes.find over the column's bytes, at C speed: a small namespace beside ten million
        pages in milliseconds, not a Python step for every slot. (A match must start at an
        item: past 256 namespaces an item is two bytes or more.)"""
        col = self.ns
        size = col.itemsize
        raw, mark, end = col.tobytes(), n.to_bytes(size, sys.byteorder), self.top * size
        at = raw.find(mark, 0, end)
        while at >= 0:
            if at % size == 0:
                yield at // size
                at = raw.find(mark, at + size, end)
            else:
                at = raw.find(mark, at + 1, end)


class PagesView(Mapping[PageId, Page]):
    """A read-only view of a store's pages on disk by (namespace, key): copies of each."""

    def __init__(self, store: PageStore, lock: threading.RLock) -> None:
        self._store, self._lock = store, lock

    def __getitem__(self, pid: PageId) -> Page:
        with self._lock:
            s = self._store.find(*pid)
            if not self._store.present(s):
                raise KeyError(pid)
            return self._store.page(s)

    def __iter__(self) -> Iterator[PageId]:
        st = self._store
        with self._lock:
            ids = [(ns, st.key(s)) for ns in st.ns_names for s in st.slots(ns)]
        return iter(ids)

    def __len__(self) -> int:
        return self._store.count
