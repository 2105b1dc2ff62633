"""Applying a batch of watcher page events to the index, settled by a stat of each file.

Page stores and deletions are settled by a stat of the file at apply time (the disk is the
truth, so a create+delete inside one batch, or an event seen twice, needs no ordering care);
reads bump the page's `reads` and `last_access`, and every read and store takes the next
`access_seq`: the clock of the chain model (cachemgr.gc.chains), which sees every event in
order and learns which page continues which; its links are stored with the rows.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from cachemgr.backends import FileFormat
from cachemgr.daemon.backlog import StoreBacklog
from cachemgr.daemon.events import Event, Kind
from cachemgr.fs._dirscan import stat_files
from cachemgr.gc.chains import ChainModel, Written
from cachemgr.layout import Layout
from cachemgr.ns.manifest import format_of
from cachemgr.state import pages_sql
from cachemgr.state.store import Store

if TYPE_CHECKING:
    from cachemgr.fs._dirscan import FileTimes


class PageEvents:
    """Applies page events to the index, giving each read and write a global sequence number.

    The sequence is the chain model's clock, not the wall clock (a burst of thousands of reads
    shares one batch time, and the order must not depend on the request rate). The counter
    resumes after the largest stored value, so the order survives a restart.
    """

    def __init__(
        self,
        layout: Layout,
        store: Store,
        model: ChainModel | None = None,
        backlog: StoreBacklog | None = None,
    ) -> None:
        self.store, self.layout = store, layout
        self._ns_root = str(layout.ns_root)  # (a Path built per event was a tenth of a batch)
        self.model = model if model is not None else ChainModel(partial(format_of, layout))
        self._fmt: dict[str, FileFormat] = {}  # of each namespace seen: an id names one engine
        self.backlog = backlog if backlog is not None else StoreBacklog()
        self._next: int | None = None  # read at first use, on the thread that applies
        self.stored_bytes = 0  # of every page file stored so far (the writer's pace)
        self._unsaved: _Batch | None = None  # observed, refused by the DB: applied again

    def apply(self, events: list[Event], *, now: float) -> dict[str, list[int]]:
        """Apply events in the order seen; returns [reads, writes] per namespace.

        A batch the DB refused (a full disk) comes again, in front of newer events: the model
        saw it already, so only what follows it is observed (else every retry would count its
        reads again and link its first page to its last)."""
        if not events:
            return {}
        if self._next is None:  # (never below the model's: it outlives a DB rebuilt from disk)
            self._next = max(pages_sql.max_access_seq(self.store.conn), self.model.clock) + 1
        b = self._unsaved
        if b is None or events[: len(b.events)] != b.events:
            b = _Batch()
        new = events[len(b.events) :]
        self._stat_all(b, new)  # (a batch applied again is settled by fresh stats)
        self._observe(b, new, now)
        self._unsaved = b
        upserts, deletes, stored, largest = self._settle(b, now)
        reads, seqs = b.reads, b.seqs
        with self.store.transaction() as conn:
            pages_sql.upsert_pages(conn, upserts)
            pages_sql.delete_pages(conn, deletes)
            pages_sql.add_reads(conn, ((n, now, seqs[key], *key) for key, n in reads.items()))
            pages_sql.set_preds(conn, ((p, *key) for key, p in b.relinks.items()))
            for ns, (r, w) in b.per_ns.items():
                pages_sql.add_lifetime(conn, ns, r, w, now)
        self._unsaved = None
        self.stored_bytes += stored
        self.backlog.done(sum(w for _, w in b.per_ns.values()), largest)
        return b.per_ns

    def _observe(self, b: _Batch, events: list[Event], now: float) -> None:
        """Feed events to the model in order, each read and write taking the next sequence."""
        seq = self._next
        assert seq is not None
        for ev in events:
            kind, ns, name, _, origin = ev
            b.events.append(ev)
            tally = b.per_ns.setdefault(ns, [0, 0])
            key = (ns, name)
            fmt = self._fmt.get(ns) or self._fmt.setdefault(ns, self.model.formats(ns))
            key_len = fmt.key_len(name) or len(name)  # pages only; a nested page's key: its path
            if kind is Kind.GONE:
                b.touched[key] = b.touched.get(key, False)
                b.key_lens[key] = key_len
                continue
            if kind is Kind.READ:
                b.reads[key] += 1
                tally[0] += 1
                changed, pred = self.model.observe_read(
                    ns, name, key_len, seq=seq, at=now, origin=origin
                )
                if changed:  # stored in every file's row: each is the page's on a restart
                    b.relinks.update(((ns, n), pred) for n in self.model.names(ns, name[:key_len]))
            else:
                b.touched[key] = True
                b.key_lens[key] = key_len
                tally[1] += 1
                st = b.stats[key]
                b.sized[key] = 0 if st is None else st[0]
                pred = self.model.observe_write(
                    ns,
                    name,
                    key_len,
                    seq=seq,
                    at=now,
                    guess=fmt.write_order,
                    written=self._written(st, now, fmt.write_order),
                    origin=origin,
                )
                if pred is not None:
                    b.preds[key] = pred
            b.seqs[key] = seq
            seq += 1
        self._next = seq

    def _stat_all(self, b: _Batch, events: list[Event]) -> None:
        """Stat every file the batch stored or saw go, in one call that lets the GIL go once
        (a stat each gave it up twice a store, and waited to take it back behind GC and the
        watcher). All are taken after every event of the batch happened, as before: a store's
        stat tells when it was written, and settles it unless it is gone by now."""
        keys = dict.fromkeys(b.touched)
        keys.update((ev[1:3], None) for ev in events if ev[0] is Kind.WRITE or ev[0] is Kind.GONE)
        b.stats = dict(zip(keys, stat_files(self._ns_root, list(keys)), strict=True))

    @staticmethod
    def _written(st: FileTimes | None, now: float, times: bool) -> Written:
        """When a page file was written, by the writer's clock: its mtime (when its last write
        began), birth time (when its temp file was made: None if the filesystem keeps none)
        and ctime (when it was renamed into place). They tell one request's burst of stores
        from the next request's (cachemgr.gc.chains.BURST_GAP) however late the daemon sees
        them: a backlog the watcher reads at once is seen all at one time. A file gone
        already: -inf (no store after it continues it). Without `times` (a format whose
        stores are no links): written `now`, the size alone from the stat."""
        if not times:
            return Written(now, size=0 if st is None else st[0])
        return Written(-math.inf) if st is None else Written(st[1], st[3], st[2], st[0])

    def _settle(
        self, b: _Batch, now: float
    ) -> tuple[list[pages_sql.PageRow], list[tuple[str, str]], int, int]:
        """Split touched pages into rows to upsert (file exists) and rows to delete, and count
        the bytes stored (and the largest file stored); the model takes the sizes found and
        forgets the files that are gone."""
        stored_bytes = largest = 0
        upserts: list[pages_sql.PageRow] = []
        deletes: list[tuple[str, str]] = []
        for (ns, name), stored in b.touched.items():
            key_len = b.key_lens[(ns, name)]
            st = b.stats[ns, name]
            if st is None:
                deletes.append((ns, name))
                self.model.remove(ns, [(name, key_len)])
                continue
            size = st[0]
            seen = now if stored else min(st[1], now)
            seq = b.seqs.get((ns, name), 0)
            if stored:
                stored_bytes += size
                largest = max(largest, size)
            if not stored or b.sized[ns, name] != size:  # (else its store modelled it so)
                self.model.add(ns, name, key_len, size, seq=seq, at=seen)
            upserts.append((ns, name, size, seen, seen, seq, key_len, b.preds.get((ns, name)), seq))
        return upserts, deletes, stored_bytes, largest


@dataclass
class _Batch:
    """What the model learned from a batch of events, until the index has it too."""

    events: list[Event] = field(default_factory=list)
    touched: dict[tuple[str, str], bool] = field(default_factory=dict)  # -> stored in it
    key_lens: dict[tuple[str, str], int] = field(default_factory=dict)  # of the touched names
    reads: Counter[tuple[str, str]] = field(default_factory=Counter)
    seqs: dict[tuple[str, str], int] = field(default_factory=dict)  # -> its last access's seq
    preds: dict[tuple[str, str], str] = field(default_factory=dict)  # -> a write's first guess
    # (ns, name) -> its page's predecessor relearned from reads (None: the link dropped)
    relinks: dict[tuple[str, str], str | None] = field(default_factory=dict)
    per_ns: dict[str, list[int]] = field(default_factory=dict)  # ns -> [reads, writes]
    sized: dict[tuple[str, str], int] = field(default_factory=dict)  # -> size its store saw
    # (ns, name) -> what its lstat said after the batch's events (None: gone): one stat per
    # file touched, for the model's burst rule and `_settle`
    stats: dict[tuple[str, str], FileTimes | None] = field(default_factory=dict)
