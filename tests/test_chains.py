"""The chain model learns which page continues which from the order of accesses alone, and
the value order evicts tails before heads, ended or rare chains before returning ones."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from pathlib import Path

from cachemgr.fs.usage import DiskUsage
from cachemgr.gc.chains import ChainModel, Written
from cachemgr.gc.policy import GcPolicy, over_limits
from cachemgr.gc.value import eviction_order
from cachemgr.state import pages_sql
from cachemgr.state.store import Store

SUFFIX = "_m_0_1.bin"  # rank 0 of 1
KEY_LEN = 64


def key(n: int) -> str:
    return f"{n:064x}"


class Stream:
    """Feeds a model what the index sees: reads and writes in order, one clock tick each."""

    def __init__(self, model: ChainModel) -> None:
        self.model = model
        self.seq: Iterator[int] = itertools.count(1)
        self.at = 0.0  # the time of each access (a request's own come back to back)

    def read(self, *pages: int, suffix: str = SUFFIX, ns: str = "ns", origin: str = "") -> None:
        for p in pages:
            name = key(p) + suffix
            self.model.observe_read(
                ns, name, KEY_LEN, seq=next(self.seq), at=self.at, origin=origin
            )

    def write(self, *pages: int, suffix: str = SUFFIX, ns: str = "ns", origin: str = "") -> None:
        for p in pages:
            name = key(p) + suffix
            seq = next(self.seq)
            self.model.observe_write(ns, name, KEY_LEN, seq=seq, at=self.at, origin=origin)
            self.model.add(ns, name, KEY_LEN, 100, seq=0, at=self.at)  # the stat at settle

    def request(self, hits: list[int], new: list[int]) -> None:
        """One SGLang request: its prefix read head to tail, then its new pages written."""
        self.read(*hits)
        self.write(*new)


def preds(model: ChainModel) -> dict[int, int | None]:
    return {
        int(k, 16): None if p.pred is None else int(p.pred, 16) for (_, k), p in model.pages.items()
    }


def order(model: ChainModel, before: float = math.inf) -> list[int]:
    return [int(v.key, 16) for v in eviction_order(model, before=before)]


def test_links_are_learned_from_one_request_and_its_return() -> None:
    model = ChainModel()
    s = Stream(model)
    s.request([], [1, 2, 3])  # a system prompt
    s.request([1, 2, 3], [10, 11])  # session A's first turn
    s.request([1, 2, 3, 10, 11], [12])  # A returns
    assert preds(model) == {1: None, 2: 1, 3: 2, 10: 3, 11: 10, 12: 11}


def test_interleaved_requests_are_repaired_by_later_reads() -> None:
    model = ChainModel()
    s = Stream(model)
    s.request([], [1, 2])
    # A and B run concurrently: both prefetches read, then both write back.
    s.read(1, 2)
    s.read(1, 2)
    s.write(10, 11)  # A: 10's first guess is 2 (right)
    s.read(1, 2, 10, 11)  # A returns before B has written: B's pages come after A's reads
    s.write(20, 21)  # B: 20's first guess is 11 (wrong: A's page)
    s.write(12)  # A's new page: guessed 21 (wrong)
    assert preds(model)[20] == 11 and preds(model)[12] == 21
    s.request([1, 2, 20, 21], [])  # B reads its prefix: 20 follows 2
    s.request([1, 2, 10, 11, 12], [])
    assert preds(model)[20] is None and preds(model)[12] is None  # doubted
    s.request([1, 2, 20, 21], [])  # a second request agrees: relinked
    s.request([1, 2, 10, 11, 12], [])
    assert preds(model) == {1: None, 2: 1, 10: 2, 11: 10, 20: 2, 21: 20, 12: 11}


def test_each_rank_is_its_own_stream() -> None:
    model = ChainModel()
    s = Stream(model)
    ranks = ["_m_0_2.bin", "_m_1_2.bin"]
    # Two ranks' I/O threads interleave file by file; each rank's order is still the chain's.
    for p in (1, 2, 3):
        for r in ranks:
            s.write(p, suffix=r)
    assert preds(model) == {1: None, 2: 1, 3: 2}
    assert all(len(page.files) == 2 for page in model.pages.values())


def test_each_node_of_a_fleet_is_its_own_stream() -> None:
    """A fleet's leader hears the other nodes' reads and stores in their summaries, interleaved
    with its own (cachemgr.daemon.fleet.feed): each node's requests teach their own links."""

    def two_nodes(a: str, b: str) -> dict[int, int | None]:
        model = ChainModel()
        s = Stream(model)
        s.request([], [1, 2])  # the system prompt
        s.request([1, 2], [10, 11])  # session 10's first turn
        s.request([1, 2], [20, 21])  # session 20's
        # Node `a` serves session 10's return while node `b` serves 20's, access by access.
        for x, y in zip([1, 2, 10, 11], [1, 2, 20, 21], strict=True):
            s.read(x, origin=a)
            s.read(y, origin=b)
        s.write(12, origin=a)
        s.write(22, origin=b)
        return preds(model)

    apart = two_nodes("", "gpu-2")
    assert apart == {1: None, 2: 1, 10: 2, 11: 10, 12: 11, 20: 2, 21: 20, 22: 21}
    # Heard as one stream, the same accesses link each node's new page to the other's.
    merged = two_nodes("", "")
    assert merged[12] == 21 and merged[22] == 12


def test_a_link_that_would_close_a_cycle_is_refused() -> None:
    model = ChainModel()
    s = Stream(model)
    s.request([], [1, 2, 3])
    # The next request reads 1 right after 3 (the last page of the previous one):
    s.read(1, 2, 3)
    s.read(1)
    assert preds(model)[1] is None  # never 3: 1 is 3's ancestor


def test_tails_go_before_heads_and_shared_pages_last() -> None:
    model = ChainModel()
    s = Stream(model)
    s.request([], [1, 2])  # shared prefix
    s.request([1, 2], [10, 11, 12])  # A
    s.request([1, 2], [20, 21])  # B
    got = order(model)
    assert got[-2:] == [2, 1]  # the shared prefix goes once nothing hangs on it
    for chain in ([10, 11, 12], [20, 21]):
        positions = [got.index(p) for p in chain]
        assert positions == sorted(positions, reverse=True)  # tail first


def test_a_chain_that_keeps_returning_outlives_one_that_went_quiet() -> None:
    model = ChainModel()
    s = Stream(model)
    s.request([], [1])
    s.request([1], [10])  # A: one visit
    s.request([1], [20])  # B: visits again and again
    for n in range(21, 30):
        s.request([1, *range(20, n)], [n])
    got = order(model)
    assert got.index(10) < got.index(29)
    assert got[0] == 10  # the chain seen once and quiet since goes first


def test_pages_behind_a_confirmed_gap_go_first() -> None:
    model = ChainModel()
    s = Stream(model)
    s.request([], [1, 2, 3])
    s.request([1, 2, 3], [])  # the links are confirmed by a read
    s.request([1, 2, 3], [])
    model.remove("ns", [(key(2) + SUFFIX, KEY_LEN)])  # 2 deleted by someone else
    got = order(model)
    assert got[0] == 3  # unusable: SGLang stops at the gap


def test_min_age_holds_a_page_and_its_ancestors() -> None:
    model = ChainModel()
    model.add("ns", key(1) + SUFFIX, KEY_LEN, 100, seq=1, at=10.0)
    model.add("ns", key(2) + SUFFIX, KEY_LEN, 100, seq=2, at=20.0, pred=key(1))
    assert order(model, before=15.0) == []  # 2 is young, and 1 must outlive it
    assert order(model, before=25.0) == [2, 1]


def test_pages_of_no_chain_go_oldest_first_and_young_ones_stay() -> None:
    """Pages a scan indexed, no read has linked yet (a chain of one page each, as every page
    of a restarted daemon's million is): each is its segment, valued without a walk."""
    model = ChainModel()
    for n, at in ((1, 30.0), (2, 10.0), (3, 20.0), (4, 50.0)):
        model.add("ns", key(n) + SUFFIX, KEY_LEN, 100, seq=0, at=at)
    assert order(model, before=40.0) == [2, 3, 1]  # 4 is younger than min_age
    got = [(int(v.key, 16), v.names, v.size) for v in eviction_order(model, before=math.inf)]
    assert got == [(n, (key(n) + SUFFIX,), 100) for n in (2, 3, 1, 4)]


def test_a_page_in_flight_keeps_its_chain_until_the_writer_moves_on_or_stops() -> None:
    model = ChainModel(in_flight=5)
    for n in range(1, 101):  # 100 unrelated pages, long done
        model.add("ns", key(n) + SUFFIX, KEY_LEN, 100, seq=n, at=0.0)
    for seq, n in ((101, 200), (102, 201)):  # a request's write burst: 200 <- 201
        model.observe_write("ns", key(n) + SUFFIX, KEY_LEN, seq=seq, at=100.0)
        model.add("ns", key(n) + SUFFIX, KEY_LEN, 100, seq=0, at=100.0)
    # 201 was written by a request that may still be writing what follows it: it and its
    # prefix stay; the rest may go.
    got = [int(v.key, 16) for v in eviction_order(model, before=math.inf, now=100.5)]
    assert 200 not in got and 201 not in got and len(got) == 100
    # Two seconds later nothing is in flight, even if no access came since (the writer stopped).
    got = [int(v.key, 16) for v in eviction_order(model, before=math.inf, now=102.5)]
    assert got.index(201) < got.index(200)
    # The stream's next request reads other pages: 201's request is done, whatever the time.
    model.observe_read("ns", key(1) + SUFFIX, KEY_LEN, seq=103, at=100.5)
    got = [int(v.key, 16) for v in eviction_order(model, before=math.inf, now=100.5)]
    assert 201 in got and 200 in got and 1 not in got


def test_only_the_request_being_served_is_in_flight_not_every_recent_read() -> None:
    """Run F: every page read lately held its whole chain, and at full speed that was nearly
    every chain. Only the page each stream accessed last (its request may write behind it)
    and its prefix stay."""
    model = ChainModel(in_flight=10_000)
    s = Stream(model)
    for c in range(20):  # 20 chains of 10 pages, each read again since
        s.at += 0.1
        s.request([], [100 * c + p for p in range(10)])
    for c in reversed(range(20)):
        s.read(*(100 * c + p for p in range(10)))
    got = [int(v.key, 16) for v in eviction_order(model, before=math.inf, now=s.at)]
    assert len(got) == 190  # the last chain read (on the one stream) stays, with its prefix
    assert not set(range(10)) & set(got)


def test_stores_of_different_requests_are_not_one_chain() -> None:
    """A write-only stream (unique prompts of 4 pages every 100 ms) was learned as one chain:
    its newest pages, in flight, held every older page, and once the writer stopped, tails
    first evicted the newest pages first. Only one request's burst of stores is a chain."""
    model = ChainModel()
    seq = itertools.count(1)
    for burst in range(10):
        for p in range(4):
            name = key(10 * burst + p) + SUFFIX
            at = burst * 0.1 + p * 0.0001
            model.observe_write("ns", name, KEY_LEN, seq=next(seq), at=at, written=Written(at))
            model.add("ns", name, KEY_LEN, 100, seq=0, at=at)
    want = {10 * b + p: (10 * b + p - 1 if p else None) for b in range(10) for p in range(4)}
    assert preds(model) == want
    got = order(model)
    assert got[:4] == [3, 2, 1, 0]  # the oldest request's pages first, its tail first
    assert got[-4:] == [93, 92, 91, 90]


def test_a_store_after_a_pause_is_a_vote_a_read_confirms() -> None:
    model = ChainModel()
    model.observe_write("ns", key(1) + SUFFIX, KEY_LEN, seq=1, at=0.0)
    model.observe_write("ns", key(2) + SUFFIX, KEY_LEN, seq=2, at=1.0)  # another request?
    assert preds(model)[2] is None
    s = Stream(model)
    s.seq = itertools.count(3)
    s.read(1, 2)  # a request reads 2 right after 1: with the store's vote, two agree
    assert preds(model)[2] == 1


def test_a_vote_belongs_to_its_page_not_to_the_slot_it_leaves() -> None:
    """Votes sit in a table of their own keyed by slot: a page gone takes its vote with it (a
    new page in its slot has none), and the others keep theirs through the table's shuffles."""
    model = ChainModel()
    s = Stream(model)
    pages = range(1, 301)
    for p in pages:
        model.add("ns", key(p) + SUFFIX, KEY_LEN, 100, seq=next(s.seq), at=0.0)
    for p in pages:
        s.read(1000 + p, p)  # a first vote: p comes after 1000 + p (not a page: no link yet)
    st = model.store
    assert len(st.votes) == 300 and all(preds(model)[p] is None for p in pages)
    gone = set(random.Random(3).sample(pages, 250))
    slot_of = {p: st.find("ns", key(p)) for p in gone}
    model.remove("ns", [(key(p) + SUFFIX, KEY_LEN) for p in gone])
    assert len(st.votes) == 50
    for p in sorted(gone):  # a new page in each freed slot, read after what its slot voted for
        q = 2000 + p
        model.add("ns", key(q) + SUFFIX, KEY_LEN, 100, seq=next(s.seq), at=0.0)
        assert st.find("ns", key(q)) in slot_of.values()
        s.read(1000 + p, q)
    for p in pages:
        if p not in gone:
            s.read(1000 + p, p)  # the second vote in a row: linked
    got = preds(model)
    assert all(got[2000 + p] is None for p in gone)  # one vote each: not linked
    assert all(got[p] == 1000 + p for p in pages if p not in gone)


def test_the_writers_pace_counts_at_most_half_the_watermarks_gap() -> None:
    policy = GcPolicy(max_bytes=1000, high_watermark=1.0, low_watermark=0.9)
    disk = DiskUsage(10**12, 10**11, 10**11)
    assert over_limits(policy, {"ns": 960}, disk).root is None
    # At most 50 bytes ahead (half of 1.0 - 0.9): over, and down to 900 - 50, never further.
    assert over_limits(policy, {"ns": 960}, disk, ahead=10**6).root == 110
    assert over_limits(policy, {"ns": 960}, disk, ahead=20).root is None


def test_the_model_survives_a_restart_through_the_index(tmp_path: Path) -> None:
    model = ChainModel()
    s = Stream(model)
    s.request([], [1, 2, 3])
    s.request([1, 2, 3], [4])
    rows = [
        ("ns", k + suffix, size, 0.0, 0.0, page.last, KEY_LEN, page.pred, page.born)
        for (_, k), page in model.pages.items()
        for suffix, size in page.files
    ]
    with Store.open(tmp_path / "state.db") as store:
        with store.transaction() as conn:
            pages_sql.upsert_pages(conn, rows)
            reads = [
                (p.reads, 0.0, p.last, "ns", n)
                for (_, k), p in model.pages.items()
                for n in p.names(k)
            ]
            pages_sql.add_reads(conn, reads)
        again = ChainModel.from_index(store.conn, ["ns"])
    assert preds(again) == preds(model)
    assert order(again) == order(model)
