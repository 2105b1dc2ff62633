"""The chain model's compact page store: a fraction of the memory of a Python object per page,
the same eviction order, and segments kept between orders (a GC run after the first walks only
what changed) without changing a single victim."""

from __future__ import annotations

import math
import random
import tracemalloc
from pathlib import Path

from cachemgr.gc.chains import ChainModel
from cachemgr.gc.pagestore import NONE
from cachemgr.gc.value import CACHED, eviction_order
from cachemgr.gc.votes import Votes
from cachemgr.state import pages_sql
from cachemgr.state.store import Store

SUFFIX = "_Qwen-Qwen3-8B_0_1.bin"
NS = "0123456789abcdef"


def key(n: int) -> str:
    return f"{n * 2654435761 % (1 << 64):064x}"  # 64 hex digits, as SGLang's sha256 keys


def chains(model: ChainModel, pages: int, length: int) -> None:
    """`pages` pages in chains of `length`, as a load from the index adds them."""
    _chains_in(model, NS, pages, length, 0)


def keys(model: ChainModel, *, before: float = math.inf, now: float = math.inf) -> list[str]:
    return [v.key for v in eviction_order(model, before=before, now=now)]


def test_a_page_costs_about_fifty_bytes() -> None:
    n = 20_000
    tracemalloc.start()
    try:
        model = ChainModel()
        chains(model, n, 50)
        used = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    # A dict of page objects took ~680 bytes a page (bench/RESULTS.md); the arrays, the keys'
    # fingerprints and the key table take ~51 at 20K (~44 at 200K: the key file's buffer of
    # keys not written yet is 64 KiB at any size); ~81 when the packed keys were in memory
    # and the last use's time a double.
    assert used / n < 55, used / n
    assert len(model.pages) == n
    page = model.pages[(NS, key(7))]
    assert page.pred == key(6) and page.files == ((SUFFIX, 1024),) and page.reads == 0


def test_keys_of_another_shape_are_kept_as_they_are() -> None:
    model = ChainModel()
    odd = ["00ab", "ABCDEF" + "0" * 58, "a" * 63 + " ", "0" * 64]
    for i, k in enumerate(odd):
        model.add(NS, k + SUFFIX, len(k), 10, seq=i + 1, at=0.0, pred=odd[i - 1] if i else None)
    assert {k for _, k in model.pages} == set(odd)
    assert keys(model) == odd[::-1]  # one chain: tail first
    assert model.names(NS, "ABCDEF" + "0" * 58) == ("ABCDEF" + "0" * 58 + SUFFIX,)
    assert model.names(NS, "abcdef" + "0" * 58) == ()  # not the same key


def block_path(i: int, group: int = 0, folder: str = "Qwen_Qwen3-0.6B_0123456789ab") -> str:
    """A vLLM block's path below its namespace dir: a nested page's key is its path."""
    h = key(i)
    return f"{folder}_r0/{h[:3]}/{h[3:5]}_g{group}/{h}.bin"


def test_a_path_key_is_packed_with_its_shape_not_kept_whole() -> None:
    n = 10_000
    paths = [block_path(i, group) for i in range(n // 2) for group in (0, 1)]
    tracemalloc.start()
    try:
        model = ChainModel()
        for seq, path in enumerate(paths, 1):
            model.add(NS, path, len(path), 48, seq=seq, at=0.0)
        used = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    store = model.store
    # Each 120-character path was a string on the side (~290 B a block at 10M blocks); now
    # its hash is packed like an SGLang key and its dirs are one of two shapes (_g0, _g1).
    assert not store.odd and len(store.shapes) == 3
    assert used / n < 60, used / n
    # Two groups of one hash are two pages, each named back exactly as it was stored.
    assert {k for _, k in model.pages} == set(paths)
    assert model.names(NS, paths[1]) == (paths[1],)
    model.remove(NS, [(paths[0], len(paths[0]))])
    assert (NS, paths[0]) not in model.pages and (NS, paths[1]) in model.pages


def test_a_key_has_one_shape_whatever_came_before_it() -> None:
    """A folder whose name starts with hex letters (`deepseek-ai_…`) beside runs that start
    with them: each key is found after any other (a shape taken from the key before it gave
    one key two fingerprints: a page removed stayed, its reads went to a ghost)."""
    folder = "deepseek-ai_DeepSeek-V3_0123456789ab_r0"
    runs = ["1" * 64, "de5a7" + "0" * 59, "dee" + "1" * 61, "deepe" + "2" * 59]
    paths = [f"{folder}/{h[:3]}/{h[3:5]}_g{g}/{h}.bin" for h in runs for g in (0, 1)]
    model = ChainModel()
    for seq, path in enumerate(paths, 1):
        model.add(NS, path, len(path), 48, seq=seq, at=0.0)
    store = model.store
    for path in paths:
        for other in [*paths, "f" * 64]:
            store.find(NS, other)
            assert store.names(store.find(NS, path)) == (path,)
    model.remove(NS, [(paths[3], len(paths[3]))])
    assert len(model.pages) == len(paths) - 1 and (NS, paths[3]) not in model.pages


def test_any_key_with_a_hex_run_comes_back_exactly() -> None:
    """Whatever is around the run (dirs that repeat its digits by chance, hex in the folder's
    name, a second run, no dirs at all), a key is named back as it came, and only itself."""
    rng = random.Random(7)
    bits = ["", "/", "_g0", "r0", "de", "dead", "beef_", "00", "x", "é", "\udcff", "a" * 64]
    made = set()
    model = ChainModel()
    for i in range(3000):
        h = key(i)
        parts = [rng.choice(bits) + h[: rng.randrange(6)] + rng.choice(bits) for _ in range(3)]
        k = "/".join(parts) + "/" + h + rng.choice(["", ".bin", "_x", "/" + h[:3]])
        if k in made:
            continue
        made.add(k)
        model.add(NS, k, len(k), 1, seq=i + 1, at=0.0)
    assert {k for _, k in model.pages} == made
    assert all(model.names(NS, k) == (k,) for k in made)


class Twin:
    """Two models fed the same events; the reference forgets its segments before each order,
    so it walks every page as an order did before segments were kept."""

    def __init__(self, in_flight: int) -> None:
        self.live, self.ref = ChainModel(in_flight=in_flight), ChainModel(in_flight=in_flight)
        self.seq = 0

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        def both(*args: object, **kw: object) -> object:
            getattr(self.ref, name)(*args, **kw)
            return getattr(self.live, name)(*args, **kw)

        return both

    def orders(self, **kw: float) -> tuple[list[str], list[str]]:
        self.ref.segments.clear()
        self.ref.dirty.clear()
        return keys(self.live, **kw), keys(self.ref, **kw)


def test_kept_segments_never_change_the_order() -> None:
    rng = random.Random(7)
    twin = Twin(in_flight=30)
    sessions: list[list[int]] = [[] for _ in range(12)]
    fresh = iter(range(1, 10**6))
    for step in range(400):
        twin.seq += 1
        t = float(twin.seq)
        s = rng.randrange(len(sessions))
        suffix = SUFFIX if rng.random() < 0.9 else "_Qwen-Qwen3-8B_1_2.bin"
        for p in sessions[s]:  # a request: its prefix read head to tail ...
            twin.seq += 1
            twin.observe_read(NS, key(p) + suffix, 64, seq=twin.seq, at=t)
        for _ in range(rng.randrange(1, 9)):  # ... and its new pages written
            p = next(fresh)
            sessions[s].append(p)
            twin.seq += 1
            twin.observe_write(NS, key(p) + suffix, 64, seq=twin.seq, at=t)
            twin.add(NS, key(p) + suffix, 64, 100, seq=0, at=t)
        if rng.random() < 0.03:  # a new chat on a shared prefix
            sessions[s] = sessions[rng.randrange(len(sessions))][: rng.randrange(1, 8)]
        if rng.random() < 0.03 and sessions[s]:  # someone deletes a page in the middle
            twin.remove(NS, [(key(rng.choice(sessions[s])) + SUFFIX, 64)])
        live, ref = twin.orders(before=t - rng.choice([-math.inf, 3, 50]), now=t + rng.random() * 3)
        assert live == ref, step
        if step % 5 == 0:  # GC: the head of the order goes
            twin.remove(
                NS, [(n, 64) for k in live[: rng.randrange(1, 30)] for n in twin.live.names(NS, k)]
            )
    assert twin.live.segments  # long segments were read, not walked, by the later orders
    assert max(len(c) for c in sessions) > CACHED


def test_an_order_after_the_first_walks_only_the_segments_that_changed() -> None:
    model = ChainModel()
    chains(model, 40 * 100, 100)  # 40 chains of 100 pages
    first = keys(model)
    known = dict(model.segments)
    assert len(known) == 40  # every segment walked once, and kept
    gone = first[:150]  # the first chain to go, and half the next
    model.remove(NS, [(k + SUFFIX, 64) for k in gone])
    last = {key(i): i for i in range(4000)}[first[-1]]  # the head of the chain that goes last
    model.add(NS, key(last + 5) + SUFFIX, 64, 1024, seq=10**6, at=1e6)  # that chain is read
    again = keys(model)
    # The next order read 37 segments as they were (the same objects), walked the 2 changed.
    kept = [leaf for leaf, seg in known.items() if model.segments.get(leaf) is seg]
    assert len(kept) == 37 and len(model.segments) == 39
    model.segments.clear()  # walking every page gives the same order
    assert keys(model) == again and sorted(again) == sorted(set(first) - set(gone))


def test_the_first_eviction_after_a_restart_orders_what_the_index_loaded(tmp_path: Path) -> None:
    live = ChainModel()
    chains(live, 30 * 40, 40)
    for seq in range(2000, 2120, 40):  # chain 0 returns thrice (read head to tail): it stays
        for p in range(40):
            live.observe_read(NS, key(p) + SUFFIX, 64, seq=seq + p, at=seq + p)
    rows = [
        (NS, k + suffix, size, 0.0, page.last_time, page.last, 64, page.pred, page.born)
        for (_, k), page in live.pages.items()
        for suffix, size in page.files
    ]
    with Store.open(tmp_path / "state.db") as store:
        with store.transaction() as conn:
            pages_sql.upsert_pages(conn, rows)
            pages_sql.add_reads(
                conn,
                [
                    (p.reads, p.last_time, p.last, NS, k + SUFFIX)
                    for (_, k), p in live.pages.items()
                ],
            )
        restarted = ChainModel.from_index(store.conn, [NS])
    # No order was kept across the restart: the loaded pages give it, victim for victim.
    assert not restarted.segments
    assert keys(restarted) == keys(live)
    assert keys(restarted)[-1] == key(0)  # the returning chain's head goes last
    assert len(restarted.segments) == len(live.segments) == 30


def test_a_forgotten_namespace_leaves_nothing_behind() -> None:
    model = ChainModel()
    chains(model, 300, 30)
    model.add("other", key(1) + SUFFIX, 64, 10, seq=1000, at=0.0, pred=key(0))  # a ghost above
    model.forget(NS)
    assert len(model.pages) == 1 and model.names(NS, key(5)) == ()
    model.add("third", key(5) + SUFFIX, 64, 10, seq=1001, at=0.0)  # takes NS's number again
    assert model.names("third", key(5)) == (key(5) + SUFFIX,) and model.names(NS, key(5)) == ()
    assert sorted(model.pages) == [("other", key(1)), ("third", key(5))]
    assert keys(model) == [key(1), key(5)]
    model.forget("other")  # its page and the ghost it named go: every slot is free again
    assert model.store.top - len(model.store.freed) == 1


def _chains_in(model: ChainModel, ns: str, pages: int, length: int, first: int) -> None:
    """`chains`, in namespace `ns`, from key(first) on."""
    for i in range(first, first + pages):
        pred = None if (i - first) % length == 0 else key(i - 1)
        row = (key(i) + SUFFIX, 64, 1024, float(i), i + 1, i // length % 4, pred, i + 1)
        model.add_indexed(ns, row)


def test_a_namespace_beside_others_goes_at_once_as_a_slot_at_a_time() -> None:
    """Its slots, pages and ghosts, go in one sweep of the key table (a probe a key took
    1.5 µs a slot: 15 s at 10M, the model's lock held): what is left is what dropping its
    pages one at a time left (the others' pages, links and order), and its slots are taken
    again when it comes back."""
    at_once, stepwise = ChainModel(), ChainModel()
    for model in (at_once, stepwise):
        chains(model, 300, 30)
        model.add_indexed(NS, (key(5000) + SUFFIX, 64, 1024, 0.0, 5001, 0, key(4999), 5001))
        _chains_in(model, "other", 200, 20, 100)  # (the same keys, another namespace's pages)
        keys(model)  # (an order caches segments whose slots the forget frees)
    assert at_once.store.find(NS, key(4999)) >= 0  # (a ghost: named as a predecessor only)
    top = at_once.store.top
    at_once.forget(NS)
    st = stepwise.store
    for s in list(st.slots(NS)):  # (as forget did before)
        stepwise._drop(s)
    st.forget_ns(NS)
    assert sorted(at_once.pages) == sorted(stepwise.pages) and len(at_once.pages) == 200
    assert keys(at_once) == keys(stepwise)
    assert sorted(at_once.store.freed) == sorted(st.freed) and at_once.store.count == 200
    assert at_once.store.find(NS, key(4999)) < 0 and not list(at_once.store.slots(NS))
    chains(at_once, 300, 30)  # back, in the slots it left
    assert at_once.store.top == top and len(at_once.pages) == 500


def test_a_small_namespace_beside_a_large_one_goes_a_page_at_a_time_keeping_segments() -> None:
    """A sweep of the whole key table takes seconds at ten million pages: a namespace of a few
    pages beside a large one goes a page at a time, and the segments the last order cached for
    the large one stay cached (a sweep drops them all: the next order walks every segment
    again). What is left is what the sweep leaves."""
    paged, swept = ChainModel(), ChainModel()
    for model in (paged, swept):
        chains(model, 3000, 30)
        _chains_in(model, "small", 40, 20, 5000)
        keys(model)  # (the order caches every segment of more than CACHED pages)
    small = set(paged.store.slots("small"))
    kept = {leaf: seg for leaf, seg in paged.segments.items() if leaf not in small}
    assert len(kept) == 100  # (the large namespace's chains)
    paged.forget("small")
    swept.store.drop_ns("small")
    swept.segments.clear()
    assert kept.items() <= paged.segments.items()
    assert sorted(paged.pages) == sorted(swept.pages) and len(paged.pages) == 3000
    assert keys(paged) == keys(swept)
    assert sorted(paged.store.freed) == sorted(swept.store.freed)
    assert "small" not in paged.store.ns_num and not list(paged.store.slots("small"))


def test_a_namespace_is_found_among_more_than_256() -> None:
    """Past 256 namespaces the namespace column takes two bytes a slot: its pages are found,
    and forgotten, all the same."""
    model = ChainModel()
    names = [f"{i:016x}" for i in range(300)]
    for i, ns in enumerate(names):
        _chains_in(model, ns, 2, 2, 10 * i)
    assert model.store.ns.itemsize > 1
    st = model.store
    assert [st.key(s) for s in st.slots(names[299])] == [key(2990), key(2991)]
    # (257 is bytes 01 01, also found astride 256's last item, 00 01, and 257's first)
    assert [st.key(s) for s in st.slots(names[257])] == [key(2570), key(2571)]
    model.forget(names[299])
    assert not list(st.slots(names[299])) and len(model.pages) == 598


def test_the_last_namespace_left_goes_with_the_store_whatever_its_size() -> None:
    """A large namespace swept beside a one-page one, then that one: the store is emptied,
    not kept at the size the large one left (~80 bytes a slot: ~800 MB after 10M pages)."""
    model = ChainModel()
    chains(model, 3000, 30)
    model.add("tiny", key(99_999) + SUFFIX, 64, 10, seq=5000, at=0.0)
    model.forget(NS)
    old = model.store
    model.forget("tiny")
    assert model.store is old and old.top == 0 and not old.freed and not model.pages


def test_a_row_naming_its_own_page_as_predecessor_links_nothing() -> None:
    """A damaged index row whose predecessor is its own key: no link (a page its own parent
    was freed twice when dropped, and the second free looked for its slot in the key table for
    ever, the model's lock held: a load of its namespace, which forgets it first, hung)."""
    model = ChainModel()
    chains(model, 300, 30)
    model.add_indexed("small", (key(9001) + SUFFIX, 64, 1024, 0.0, 9002, 0, key(9001), 9002))
    st = model.store
    s = st.find("small", key(9001))
    assert st.pred[s] == NONE and st.kids[s] == 0
    model.forget("small")  # (a page at a time, beside 300)
    assert not list(st.slots("small")) and len(model.pages) == 300


def test_a_cached_segment_cut_off_behind_a_gap_goes_first_as_a_walked_one() -> None:
    """A segment whose top's predecessor is gone and that nobody read since (cut off by a
    deletion) goes first, whether the order walks it or reads it from the segments the last
    order cached (those took only a confirmed link as proof)."""
    model = ChainModel()
    for i in range(20):  # an older chain, read once
        pred = key(i - 1) if i else None
        model.add_indexed(NS, (key(i) + SUFFIX, 64, 1024, float(i), i + 1, 1, pred, i + 1))
    for i in range(100, 120):  # behind key(99), not on disk: never read since
        model.add_indexed(NS, (key(i) + SUFFIX, 64, 1024, float(i), i + 1, 0, key(i - 1), i + 1))
    walked = keys(model)
    assert model.segments and walked[0] == key(119)
    assert keys(model) == walked


def test_a_namespace_holding_every_slot_goes_with_the_store_as_one_a_slot_at_a_time() -> None:
    """The one model's dir purged: its slots go with the store (9M slots a slot at a time held
    the model's lock for most of a minute). What is left, and what comes next, is the same
    as after a forget a slot at a time (`other`: the same namespace beside another)."""
    whole, beside = ChainModel(), ChainModel()
    for model in (whole, beside):
        chains(model, 300, 30)
    beside.add("other", key(999) + SUFFIX, 64, 10, seq=1000, at=0.0)
    old = whole.store
    whole.forget(NS)
    beside.forget(NS)
    beside.forget("other")
    # Emptied in place: an order waiting for the lock took the store before it (value.py).
    assert whole.store is old and old.top == 0 and not whole.segments
    assert len(whole.pages) == len(beside.pages) == 0
    assert beside.store.top - len(beside.store.freed) == 0  # (every slot free there too)
    for model in (whole, beside):  # the namespace comes back (a bound one's dir, recreated)
        chains(model, 60, 30)
    assert keys(whole) == keys(beside) and len(whole.pages) == 60


def test_the_vote_table_holds_what_a_dict_would_through_puts_drops_and_sweeps() -> None:
    rng, votes, want = random.Random(5), Votes(), dict[int, tuple[int, int]]()
    for step in range(30_000):
        s = rng.randrange(2_000) * rng.choice((1, 64))  # (chain heads come at a stride)
        if step % 5_000 == 4_999:  # a namespace swept: every slot of a residue goes
            votes.drop_if(lambda s: s % 3 == 0)
            want = {k: v for k, v in want.items() if k % 3}
        elif rng.random() < 0.55:
            want[s] = (rng.getrandbits(64) - (1 << 63), rng.randrange(5))
            votes.put(s, *want[s])
        else:
            want.pop(s, None)
            votes.drop(s)
        assert votes.get(s) == want.get(s) and len(votes) == len(want)
    assert {s: votes.get(s) for s in range(128_000) if votes.get(s)} == want
    for s in list(want):
        votes.drop(s)
    assert len(votes.slots) == 8  # (its room went with the votes)


def test_a_vote_of_a_stream_suffix_past_255_widens_the_suffixes() -> None:
    votes = Votes()
    votes.put(1, 7, 255)
    assert votes.sfx.itemsize == 1
    votes.put(2, -7, 300)
    assert (votes.get(1), votes.get(2), votes.sfx.itemsize) == ((7, 255), (-7, 300), 4)
