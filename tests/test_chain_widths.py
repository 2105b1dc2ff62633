"""The chain model's count columns (namespace and file set numbers, children, reads)
start a byte or two wide, and its access sequences 4 bytes wide; each widens when a value
outgrows it, without changing a value; the key table takes 1.3 to 2.3 buckets a page at any
size."""

from __future__ import annotations

import math
import random
from array import array
from pathlib import Path

from cachemgr.gc import modelfile
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.keyfile import KEY_BYTES
from cachemgr.gc.pagestore import NONE, PageStore
from cachemgr.gc.value import eviction_order
from cachemgr.state import pages_sql
from cachemgr.state.store import Store
from tests import test_model_snapshot as snap
from tests.test_chain_store import NS, chains, key

# A slot's bytes in a model file before its columns: its key, its key's fingerprint, its leaf bit.
SLOT_HEAD = KEY_BYTES + 8 + 1


def order(model: ChainModel) -> list[str]:
    return [v.key for v in eviction_order(model, before=math.inf, now=math.inf)]


def test_narrow_columns_take_a_few_bytes_a_page() -> None:
    model = ChainModel()
    chains(model, 2000, 50)
    st = model.store
    widths = {c: getattr(st, c).itemsize for c in ("ns", "files", "reads", "kids")}
    assert widths == {"ns": 1, "files": 1, "reads": 2, "kids": 2}
    assert (st.born.itemsize, st.last.itemsize) == (4, 4)


def test_columns_widen_as_namespaces_file_sets_and_suffixes_grow() -> None:
    model = ChainModel()
    for i in range(300):  # 300 namespaces, file sets (sizes) and stream suffixes
        ns, sfx = f"ns{i}", f"_m_{i}_1.bin"
        model.add(ns, key(i) + sfx, 64, 1000 + i, seq=2 * i + 1, at=float(i))
        model.observe_read(ns, key(i + 1000) + sfx, 64, seq=2 * i + 2, at=float(i))  # (no page)
        model.observe_read(ns, key(i) + sfx, 64, seq=2 * i + 2, at=float(i))  # a contrary read
    st = model.store
    assert (st.ns.typecode, st.files.typecode) == ("H", "h")
    for i in (0, 127, 128, 255, 256, 299):
        s = st.find(f"ns{i}", key(i))
        page = model.pages[f"ns{i}", key(i)]
        assert page.files == ((f"_m_{i}_1.bin", 1000 + i),) and page.reads == 1
        assert st.ns_names[st.ns[s]] == f"ns{i}" and st.votes.get(s) == (hash(key(i + 1000)), i)


def test_a_count_past_its_width_widens_the_column() -> None:
    model = ChainModel()
    chains(model, 100, 10)
    st, want = model.store, order(model)
    s = st.find(NS, key(3))
    st.put("reads", s, 70_000)
    st.put("kids", st.find(NS, key(9)), 0)
    st.put("kids", st.find(NS, key(9)), 3_000_000_000)
    assert (st.reads.typecode, st.reads[s]) == ("i", 70_000)
    assert (st.kids.typecode, st.kids[st.find(NS, key(9))]) == ("q", 3_000_000_000)
    st.put("kids", st.find(NS, key(9)), 0)
    st.put("reads", s, 0)
    assert order(model) == want  # (every other value kept)


def test_a_sequence_past_32_bits_widens_its_column() -> None:
    """Past 2**32 accesses (or a birth below 0 in an index edited by hand) the sequences take
    64 bits; no value and no victim changes."""
    model, ref = ChainModel(), ChainModel()
    for m in (model, ref):
        chains(m, 200, 10)
    st = model.store
    assert st.last.typecode == "I"
    big = 1 << 32
    model.observe_read(NS, key(5) + "_m_0_1.bin", 64, seq=big + 5, at=500.0)
    model.add_indexed(NS, (key(900) + "_m_0_1.bin", 64, 1024, 501.0, big + 9, 0, key(899), -3))
    assert (st.last.typecode, st.born.typecode) == ("q", "q")
    assert model.pages[NS, key(5)].last == big + 5 and model.pages[NS, key(900)].born == -3
    # The same events on a store whose columns were 64 bits wide all along.
    ref.store.born, ref.store.last = (
        array("q", iter(ref.store.born)),
        array("q", iter(ref.store.last)),
    )
    ref.observe_read(NS, key(5) + "_m_0_1.bin", 64, seq=big + 5, at=500.0)
    ref.add_indexed(NS, (key(900) + "_m_0_1.bin", 64, 1024, 501.0, big + 9, 0, key(899), -3))
    assert dict(model.pages) == dict(ref.pages) and order(model) == order(ref)
    assert model.clock == ref.clock == big + 9


def test_the_key_table_holds_one_and_a_third_to_two_and_a_quarter_buckets_a_page() -> None:
    """Any length, not a power of two: a load sizes it at 1.5 buckets a page, and it grows
    as pages come one at a time, at three quarters full, to 2.25."""
    model = ChainModel()
    chains(model, 30_000, 50)
    st = model.store
    assert 4 / 3 * st.top <= len(st.table) <= 2.25 * st.top + 8
    assert st.filled <= 0.75 * len(st.table)
    want = order(model)
    st.reserve(0)  # (as a load from the index sizes it)
    assert len(st.table) == int(1.5 * (st.top + 1))
    assert all(st.find(NS, key(i)) == i for i in range(0, 30_000, 7))
    assert order(model) == want


def _with_header(raw: bytes, change: dict[str, int]) -> bytes:
    """A file with these header fields changed, and its CRC made right again."""
    header, body = snap.split(raw)
    return snap.joined(header | change, body)


def test_a_key_table_over_three_quarters_full_is_refused(tmp_path: Path, store: Store) -> None:
    """Probing needs empty buckets: a file whose table is three quarters full is used, one
    fuller (garbled, with a CRC that checks) is not."""
    model = ChainModel()
    chains(model, 500, 20)
    path = tmp_path / "chain-model.snapshot"
    modelfile.save(model, path, store, [NS])
    raw, size = path.read_bytes(), len(model.store.table)
    for filled, used in ((size * 3 // 4, {NS}), (size * 3 // 4 + 1, set())):
        path.write_bytes(_with_table(raw, filled))
        with store.transaction() as conn:
            pages_sql.set_model_stamp(conn, _token(raw))
        assert modelfile.restore(ChainModel(), path, store) == used


def _with_table(raw: bytes, filled: int) -> bytes:
    """A file whose key table has `filled` buckets not empty (empty ones made dead), as its
    header says, and its CRC made right again."""
    header, body = snap.split(raw)
    at = header["top"] * SLOT_HEAD + 4 * header["freed"]
    at += sum(header["top"] * array(header["columns"][c]).itemsize for c in header["columns"])
    table = array("i")
    table.frombytes(body[at : at + 4 * header["table"]])
    for i in [i for i, s in enumerate(table) if s == NONE][: filled - header["filled"]]:
        table[i] = -2  # (a dead bucket)
    header["filled"] = filled
    return snap.joined(header, body[:at] + table.tobytes() + body[at + len(table) * 4 :])


def _token(raw: bytes) -> str:
    return str(snap.split(raw)[0]["token"])


def test_sequences_at_the_32_bit_boundary_and_through_a_save(tmp_path: Path, store: Store) -> None:
    """2**32 - 1 still fits 32 bits, 2**32 widens (the last use, the birth, each its own
    column); a save keeps the wide columns, and the restored model goes on past them."""
    top = (1 << 32) - 1
    model = ChainModel()
    chains(model, 100, 10)
    st = model.store
    model.observe_read(NS, key(5) + "_m_0_1.bin", 64, seq=top, at=500.0)
    model.add_indexed(NS, (key(900) + "_m_0_1.bin", 64, 1024, 501.0, top, 0, key(899), top))
    assert (st.last.typecode, st.born.typecode) == ("I", "I")
    assert model.pages[NS, key(5)].last == top and model.pages[NS, key(900)].born == top
    model.observe_read(NS, key(6) + "_m_0_1.bin", 64, seq=top + 1, at=502.0)
    assert (st.last.typecode, st.born.typecode) == ("q", "I")
    row = (key(901) + "_m_0_1.bin", 64, 1024, 503.0, top + 2, 0, key(900), top + 2)
    model.add_indexed(NS, row)
    assert st.born.typecode == "q" and model.pages[NS, key(901)].born == top + 2
    path = tmp_path / "chain-model.snapshot"
    modelfile.save(model, path, store, [NS])
    restored = ChainModel()
    assert modelfile.restore(restored, path, store) == {NS}
    assert (restored.store.last.typecode, restored.store.born.typecode) == ("q", "q")
    assert dict(restored.pages) == dict(model.pages) and order(restored) == order(model)
    for i in range(2000, 4000):  # past the loaded key table's room
        restored.add(NS, key(i) + "_m_0_1.bin", 64, 1024, seq=top + i, at=float(i))
    assert all(restored.pages[NS, key(i)].last == top + i for i in range(2000, 4000, 97))
    assert restored.pages[NS, key(6)].last == top + 1


def test_the_key_table_through_churn_keeps_empty_buckets_and_finds_every_key() -> None:
    """Slots freed and taken again by the thousand (their buckets dead, then reused): the
    count of buckets not empty stays true, at most three quarters of the table, and every
    live key is found, odd keys and packed alike."""
    rnd = random.Random(7)
    st = PageStore()
    live: dict[tuple[str, str], int] = {}
    for step in range(30_000):
        if live and rnd.random() < 0.48:
            k = rnd.choice(list(live)) if step % 50 == 0 else next(iter(live))
            st.release(live.pop(k))
        else:
            i = rnd.randrange(10**6)
            k = (f"n{i % 3}", key(i) if i % 5 else f"odd{i}")
            live[k] = st.ensure(*k)
        assert st.filled <= 0.75 * len(st.table)
        if step % 1000 == 0:
            assert st.filled == sum(1 for b in st.table if b != NONE)
            assert all(st.find(*k) == s for k, s in live.items())
    assert st.top < 2 * len(live) + 1000  # (freed slots taken again)


def test_a_key_table_fuller_than_its_header_says_is_refused(tmp_path: Path, store: Store) -> None:
    """The header's count of buckets in use is checked against the table itself: a table
    with no empty bucket (garbled, with a CRC that checks) would send the first look-up of a
    new key round it for ever, the model's lock held (the index and GC stuck behind it)."""
    model = ChainModel()
    chains(model, 500, 20)
    path = tmp_path / "chain-model.snapshot"
    modelfile.save(model, path, store, [NS])
    header, body = snap.split(path.read_bytes())
    at = header["top"] * SLOT_HEAD + 4 * header["freed"]
    at += sum(header["top"] * array(header["columns"][c]).itemsize for c in header["columns"])
    size = header["table"]
    full = array("i", [0]) * size  # every bucket slot 0's
    path.write_bytes(snap.joined(header, body[:at] + full.tobytes() + body[at + 4 * size :]))
    assert modelfile.restore(ChainModel(), path, store) == set()
