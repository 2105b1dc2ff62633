"""The eviction order adapts (cachemgr.gc.adapt): of the orders it can follow, it follows the
one whose miniature cache (cachemgr.gc.minisim) hits most, on streams built to favour each;
the miniatures' scores do not depend on the order followed; their memory is bounded; whatever
it follows, tails go first and the victims suffice; its state and the memory of evicted pages
survive a clean restart (the model file)."""

from __future__ import annotations

import math
import random
import zlib
from collections import Counter
from itertools import islice
from pathlib import Path

import pytest

from cachemgr.gc import adapt, minisim, modelfile
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.history import REMEMBER
from cachemgr.gc.keyshape import fingerprint
from cachemgr.gc.returns import prior, worth
from cachemgr.gc.value import cap_order, eviction_order
from cachemgr.state import pages_sql
from cachemgr.state.store import Store
from tests import test_model_snapshot as snap
from tests.daemon_helpers import running_daemon
from tests.polling import wait_for
from tests.test_chain_store import NS, SUFFIX, chains
from tests.test_sim_policy import sim

PAGES = 4  # pages a chain has
OTHER_RANK = SUFFIX.replace("0", "1")  # (the file of another rank: another stream)


def _trace(requests: list[int]) -> object:
    """A trace of chains of PAGES pages each (no shared prefix), looked up in this order."""
    parent: list[int] = []
    chains: dict[int, tuple[int, ...]] = {}
    out = []
    for c in requests:
        if c not in chains:
            first = len(parent)
            parent += [-1, *range(first, first + PAGES - 1)]
            chains[c] = tuple(range(first, first + PAGES))
        out.append(chains[c])
    return sim.Trace(parent, out, len(out), [1.0] * len(parent))


def _shifting() -> object:
    """Favours recency: a working set of 10 chains read round robin, replaced by 10 new ones
    every 64 requests; chains of a past phase, read often, never come back."""
    return _trace([phase * 10 + i % 10 for phase in range(30) for i in range(64)])


def _scanned() -> object:
    """Favours probation: 6 chains read round robin, each request followed by a
    one-off chain that is never read (a scan LRU lets through)."""
    out: list[int] = []
    for i in range(2400):
        out += [i % 6, 1000 + i]
    return _trace(out)


def _serve(
    trace: object, cap: int, force: int | None = None
) -> tuple[float, Counter[str], sim.Cachemgr]:
    policy = sim.Cachemgr(100.0)
    policy.model.adapt.fixed = force
    followed: Counter[str] = Counter()
    choose = policy.model.adapt.choose

    def counting(pages: int, clock: int) -> int:
        followed[adapt.ORDERS[choose(pages, clock)]] += 1
        return policy.model.adapt.follow

    policy.model.adapt.choose = counting  # type: ignore[method-assign]
    result = sim.serve(trace, policy, cap)
    assert result.unusable_end == 0 and result.max_on_disk <= cap
    return result.ratio, followed, policy


@pytest.mark.parametrize(
    ("make", "cap", "better"),
    [(_shifting, 13 * PAGES, {"recency"}), (_scanned, 10 * PAGES, {"probation"})],
)
def test_the_adaptive_choice_follows_the_better_order(make, cap, better) -> None:
    trace = make()
    alone = {o: _serve(trace, cap, force=i)[0] for i, o in enumerate(adapt.ORDERS)}
    best = max(alone[o] for o in better)
    worse = max(r for o, r in alone.items() if o not in better)
    assert best > worse + 0.015  # (the stream favours them: else the test shows nothing)
    ratio, followed, _ = _serve(trace, cap)
    assert followed.most_common(1)[0][0] in better
    assert ratio >= best - 0.005 and ratio > worse
    # The choice's ceiling (bench/sim_policy.py --shadowed: full-size caches for miniatures)
    # ends on the better order too.
    shadowed = sim.Shadowed(trace, cap)
    ceiling = sim.serve(trace, shadowed, cap).ratio
    assert adapt.ORDERS[shadowed.follow] in better and ceiling > worse


def test_the_order_switches_only_for_a_margin_and_ties_keep_it() -> None:
    """The switch rule the daemon and the simulator's perfect miniatures share."""
    assert adapt.switched([1.0, 1.0 + adapt.MARGIN / 2, 0.0], 0) == 0  # (within the margin)
    assert adapt.switched([1.0, 1.0 + 2 * adapt.MARGIN, 0.0], 0) == 1
    assert adapt.switched([0.5, 0.5, 0.5], 2) == 2


def test_the_miniatures_score_the_same_whichever_order_is_followed() -> None:
    """The bias the shadow scoring had: each miniature sees the whole sampled stream, so what
    it scores is the same whether the real cache follows `value` or `recency` (the third,
    `probation`, reads the real store rate for its trial: close, not equal)."""
    trace = _shifting()
    minis = [_serve(trace, 13 * PAGES, force=f)[2].model.adapt.mini for f in (0, 1)]
    assert minis[0].cap == minis[1].cap > 0
    for o in (0, 1):  # (equal but for rounding: the decay is applied at other plans)
        assert math.isclose(minis[0].hits[o], minis[1].hits[o], rel_tol=1e-12)
    assert minis[0].hits[1] > minis[0].hits[0]  # (and they tell the orders apart)
    assert math.isclose(minis[0].hits[2], minis[1].hits[2], rel_tol=0.02)


def test_the_miniatures_memory_is_bounded() -> None:
    """A stream of 200,000 pages never seen again, with a cache of 100,000 pages: the sample
    holds at most MINI_PAGES a miniature plus the scaled memory of evicted pages."""
    mini = adapt.Adaptive().mini
    mini.size(100_000, 0)
    for i in range(200_000):
        mini.reference(zlib.crc32(b"%d" % i), i, read=False)
    assert 100_000 >> mini.shift <= minisim.MINI_PAGES
    bound = len(adapt.ORDERS) * minisim.MINI_PAGES + (REMEMBER >> mini.shift)
    assert 0 < len(mini.pages) <= bound and max(len(h) for h in mini.held) <= mini.cap
    big = mini.shift
    mini.size(1_000, 200_000)  # (the cap came down 100x: a higher rate, started again)
    assert mini.shift == 0 < big and mini.cap == 1_000 and not mini.pages
    mini.reference(zlib.crc32(b"new"), 200_001, read=False)
    assert len(mini.pages) == 1


def _ranked_afresh(mini: minisim.Miniatures, o: int, n: int, clock: int) -> list[int]:
    """The `n` pages miniature `o` evicts first, ranked as before the costs were cut: its
    prior summed over its pages, every page valued, all sorted (ties: use, then arrival)."""
    held = list(mini.held[o])
    pages = [mini.pages[d] for d in held]
    fit = prior([(p[minisim._READS], max(clock - p[minisim._BORN], 0)) for p in pages])
    end = mini.trial(clock, mini.cap << mini.shift) if mini.names[o] == "probation" else -1
    keys = [
        -0.5
        if p[minisim._LAST] < end and not p[minisim._READS]
        else worth(fit, p[minisim._READS], p[minisim._LAST] - p[minisim._BORN], clock - p[1])
        for p in pages
    ]
    ranked = sorted(range(len(held)), key=lambda i: (keys[i], pages[i][minisim._LAST]))
    return [held[i] for i in ranked[:n]]


def test_the_miniatures_evict_what_ranking_everything_afresh_would() -> None:
    """The cheap paths (an LRU list for `recency`, the prior's sums kept as pages come and
    go, a partial sort, `probation` valuing none when enough are past their trial) pick the
    victims a full ranking picks, through evictions, a resample and a restore."""
    a = adapt.Adaptive()
    mini = a.mini
    rng = random.Random(5)
    keys = [rng.getrandbits(63) for _ in range(3000)]
    a.choose(1000, 0)
    for clock in range(1, 30_001):
        if rng.random() < 0.4:
            a.stored(keys[clock % 3000] ^ clock, clock, True, chain=(rng.randrange(3), clock - 9))
        else:
            a.read(rng.choice(keys), clock)
        if clock % 2_500 == 0:
            for o, name in enumerate(adapt.ORDERS):
                if name == "recency":
                    lasts = [mini.pages[d][minisim._LAST] for d in mini.held[o]]
                    assert lasts == sorted(lasts)  # (least recently used first)
                    continue
                for n in (1, 10, 100):  # (`probation`: past their trial, most often 1-10)
                    assert mini._lowest(o, n, clock) == _ranked_afresh(mini, o, n, clock)
                held = [mini.pages[d] for d in mini.held[o]]
                fresh = prior([(p[minisim._READS], clock - p[minisim._BORN]) for p in held])
                assert all(map(math.isclose, mini._prior(o, clock), fresh))
            if clock == 10_000:
                a.choose(20_000, clock)  # (sampled at 1/4 now: the sums follow the sample)
                assert mini.shift == 2
            if clock == 20_000:
                again = adapt.Adaptive()
                again.restore(a.state(), a.table())
                assert again.mini.sums == mini.sums
                a, mini = again, again.mini


def test_a_page_one_miniature_evicts_at_once_stays_known_while_another_holds_it() -> None:
    """A page `value` values least the moment it comes in (unread, its chain born long ago) is
    evicted from `value` at once while `recency` keeps it: it is no ghost, and forgetting
    ghosts never drops it (it was left among the ghosts, then forgotten while held: a
    KeyError at the next eviction)."""
    a = adapt.Adaptive()
    mini = a.mini
    rng = random.Random(7)
    a.choose(1000, 0)
    for clock in range(1, 60_001):
        key = rng.getrandbits(63)
        if rng.random() < 0.5:  # (a stale chain's page: valued least at once)
            a.stored(key, clock, True, chain=(0, 1))
        else:
            a.stored(key, clock, True, chain=(rng.randrange(1, 5), clock - 20))
        if clock % 5_000 == 0:
            for held in mini.held:
                assert set(held) <= set(mini.pages)
            assert set(mini.ghosts) == {d for d, p in mini.pages.items() if not p[minisim._HELD]}


def test_the_sample_sees_pages_not_files_and_a_tail_takes_its_chains_record() -> None:
    """A second rank's file of a page is not a second reference; a page stored behind a read
    one starts with that one's record (as the real order values the segment by its top)."""
    model = ChainModel()
    head, tail = f"{1:064x}", f"{2:064x}"
    for suffix in (SUFFIX, OTHER_RANK):
        model.observe_write(NS, head + suffix, 64, seq=1, at=1.0)
    st, mini = model.store, model.adapt.mini
    record = mini.pages[st.digest(st.find(NS, head))]
    assert record[minisim._READS] == 0 and round(mini.refs) == 1
    for seq in (3, 4):
        model.observe_read(NS, head + SUFFIX, 64, seq=seq, at=2.0)
    model.observe_write(NS, tail + SUFFIX, 64, seq=5, at=2.0)  # (the same request's burst)
    assert model.pages[NS, tail].pred == head
    assert mini.pages[st.digest(st.find(NS, tail))][: minisim._HELD] == [1, 5, 2]


def test_victims_suffice_whatever_the_order_follows() -> None:
    """Every page is in flight (one request's chain): each order still yields every page, the
    second pass past the protections, tails before heads."""
    for follow in range(len(adapt.ORDERS)):
        model = ChainModel(in_flight=10**6)
        for i in range(40):
            model.observe_write(NS, f"{i:064x}" + SUFFIX, 64, seq=i + 1, at=100.0)
        model.adapt.fixed = follow
        taken = [v.key for v, _ in cap_order(model, before=math.inf, now=100.0)]
        assert sorted(set(taken)) == sorted(f"{i:064x}" for i in range(40))
        first = list(dict.fromkeys(taken))
        assert first == sorted(first, reverse=True)  # (one chain: tail first)


def _evicted(model: ChainModel) -> list[str]:
    """Run the order, evict its first 25 pages as GC does (the plan, then the removal)."""
    order = eviction_order(model, before=math.inf)
    out = [v.key for v in islice(order, 25)]
    order.close()  # (as a plan that has enough: what the other orders would take is kept)
    model.remove(NS, [(k + SUFFIX, 64) for k in out])
    return out


def test_the_memory_of_evicted_pages_and_the_choice_survive_a_restart(
    tmp_path: Path, store: Store
) -> None:
    model = ChainModel()
    chains(model, 2000, 10)
    evicted: list[str] = []
    for i in range(3):
        evicted += _evicted(model)
        for k in range(300):  # (reads between the plans, of another rank's files: the
            # miniatures score them; the stream of SUFFIX keeps no last page, as after a start)
            name = f"{(k * 7 + i) % 1900:064x}" + OTHER_RANK
            model.observe_read(NS, name, 64, seq=3000 + i * 300 + k, at=5.0)
    model.adapt.follow = 1  # (as a run that chose recency)
    assert model.history.entries() and model.adapt.mini.cap and model.adapt.mini.pages
    path = tmp_path / "chain-model.snapshot"
    modelfile.save(model, path, store, [NS])
    restored = ChainModel()
    assert modelfile.restore(restored, path, store) == {NS}
    assert restored.history.entries() == model.history.entries()
    assert restored.adapt.state() == model.adapt.state()
    assert restored.adapt.table() == model.adapt.table()
    # The same next victims, and a remembered page written again gets its record back.
    evicted += _evicted(model)
    assert _evicted(restored) == evicted[-25:]
    last = model.history.entries()[-1][1]  # (a key's fingerprint: the key is on disk)
    gone = next(k for k in evicted if fingerprint(k) == last)
    for m in (model, restored):
        m.observe_write(NS, gone + SUFFIX, 64, seq=10_000, at=9.0)
    assert restored.pages[NS, gone] == model.pages[NS, gone]


def test_a_model_file_of_an_older_build_is_not_used(tmp_path: Path, store: Store) -> None:
    """A file of version 4 (its key table found keys by their CRC-32, the keys in it were the
    model's own) would place every key in the wrong bucket: refused, the index is loaded."""
    model = ChainModel()
    chains(model, 200, 20)
    path = tmp_path / "chain-model.snapshot"
    modelfile.save(model, path, store, [NS])
    header, body = snap.split(path.read_bytes())
    path.write_bytes(snap.joined(header | {"version": 4}, body))
    with store.transaction() as conn:
        pages_sql.set_model_stamp(conn, header["token"])
    assert modelfile.restore(ChainModel(), path, store) == set()


def test_a_daemon_restart_keeps_the_memory_of_evicted_pages_and_the_order(
    tmp_path: Path,
) -> None:
    """Write → evict (the daemon's GC) → clean stop → start: the same memory and choice."""
    layout, d = snap._root(tmp_path)
    with running_daemon(snap._settings(layout)) as dm:
        model = snap._serve(dm, d, 1, 12)
        r = dm.post("/v1/gc", json={"max_bytes": "100KB"})
        assert r.status_code == 200, r.text
        assert r.json()["by_reason"]["cap"]["files"] > 0
        wait_for(lambda: len(model.history.entries()), bool, timeout=30)
        with model.lock:
            saved = model.history.entries(), model.adapt.state(), model.adapt.table()
    assert saved[1]["mini"]["cap"] >= 1 and saved[2]  # (the run sized the miniatures)
    with running_daemon(snap._settings(layout)) as dm:
        model = dm.daemon.indexer.model
        with model.lock:
            again = model.history.entries(), model.adapt.state(), model.adapt.table()
    assert again == saved
