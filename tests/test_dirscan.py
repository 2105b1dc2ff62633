"""The C directory scan against a plain Python reference: same counts, sizes and digests, through
SGLang's file format (cachemgr.sglang.hicache)."""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import replace
from functools import reduce
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachemgr.backends import FileKind
from cachemgr.errors import UnsafePathError
from cachemgr.fs import _dirscan
from cachemgr.fs._dirscan import page_digest
from cachemgr.fs.dirscan import TEMPS, Usage, list_files, scan_usage, usual_size
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.sglang.hicache import HICACHE_FILE
from tests.nsfixtures import page_name

NS = "0123456789abcdef"
FMT = HICACHE_FILE
RULES = (FMT.scan.key_min, FMT.scan.key_max, FMT.scan.temp_lead, FMT.scan.temp_hex)


def reference(d: Path) -> Usage:
    """What scan_usage must say, one os.lstat and one classify() per name."""
    keys: set[str] = set()
    files = size = temps = temp_size = other = digest = 0
    for name in os.listdir(d):
        st_ = os.lstat(d / name)
        kind = FMT.classify(name) if stat.S_ISREG(st_.st_mode) else FileKind.FOREIGN
        if kind is FileKind.PAGE:
            keys.add(name[: FMT.key_len(name)])
            files, size = files + 1, size + st_.st_size
            digest ^= page_digest(name, st_.st_size)
        elif kind is FileKind.TEMP:
            temps, temp_size = temps + 1, temp_size + st_.st_size
        else:
            other += 1
    return Usage(len(keys), size, files, temps, temp_size, other, digest=digest)


def raw_scan(d: Path, threads: int = 2) -> tuple[list[_dirscan.Group], int, int, int]:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return _dirscan.scan(fd, threads, RULES, FMT.classify)
    finally:
        os.close(fd)


def ns_dir(layout: Layout) -> Path:
    d = layout.ns_root / NS
    d.mkdir()
    return d


def test_scan_counts_pages_temps_and_others(layout: Layout) -> None:
    d = ns_dir(layout)
    for i in range(3):
        (d / page_name(i)).write_bytes(b"x" * 7)
    (d / f".{'a' * 32}.tmp").write_bytes(b"t" * 5)
    (d / "notes.txt").write_text("n")
    (d / "sub").mkdir()
    (d / page_name(9)).symlink_to(d / page_name(0))  # page-named, but never followed
    os.mkfifo(d / page_name(10))
    for i in range(5):
        (d / f".{i:032x}.tmp").write_bytes(b"t")
    # not UTF-8: SGLang never wrote it, so it is foreign (and never reaches the UTF-8 DB)
    odd_name = os.path.join(os.fsencode(d), b"%064x" % 11 + b"_m\xff_0_1.bin")
    os.close(os.open(odd_name, os.O_CREAT | os.O_WRONLY, 0o644))
    usage = scan_usage(layout, f"ns/{NS}")
    assert usage is not None
    assert (usage.pages, usage.bytes, usage.temps, usage.temp_bytes, usage.other) == (
        3,
        21,
        6,
        10,
        5,
    )
    assert usage == reference(d)
    shapes = [g[0] for g in raw_scan(d)[0]]
    assert shapes.count("." + "0" * 32 + ".tmp") == 1 and len(shapes) == 4  # temps share one
    assert scan_usage(layout, "ns/ffffffffffffffff") is None


def test_digest_is_the_xor_of_the_page_digests_and_moves_with_any_change(layout: Layout) -> None:
    d = ns_dir(layout)
    names = [page_name(i) for i in range(50)]
    for n in names:
        (d / n).write_bytes(b"p" * 64)
    first = scan_usage(layout, f"ns/{NS}")
    assert first is not None and first.digest != 0
    assert first.digest == reduce(lambda a, n: a ^ page_digest(n, 64), names, 0)
    (d / names[7]).write_bytes(b"p" * 63)  # same names and count, one size differs
    resized = scan_usage(layout, f"ns/{NS}")
    assert resized is not None and resized.digest != first.digest
    (d / names[7]).write_bytes(b"p" * 64)
    assert scan_usage(layout, f"ns/{NS}") == first
    os.rename(d / names[3], d / page_name(99))  # same count and bytes, another name
    renamed = scan_usage(layout, f"ns/{NS}")
    assert renamed is not None and (renamed.pages, renamed.bytes) == (50, 3200)
    assert renamed.digest != first.digest


def test_corrupt_pages_are_those_off_their_pools_usual_size(layout: Layout) -> None:
    d = ns_dir(layout)
    for i in range(10):
        (d / page_name(i)).write_bytes(b"k" * 100)
    (d / page_name(10)).write_bytes(b"k" * 40)  # torn
    (d / page_name(11)).write_bytes(b"")  # empty: never the usual size
    for i in range(4):  # another pool's files have their own usual size
        (d / f"{i:064x}.mamba_m_0_1.bin").write_bytes(b"s" * 8)
    usage = scan_usage(layout, f"ns/{NS}")
    assert usage is not None and (usage.pages, usage.files, usage.corrupt) == (12, 16, 2)


def test_a_thousand_odd_sizes_are_all_counted_corrupt(layout: Layout) -> None:
    d = ns_dir(layout)
    odd = 1000  # with the usual size, 1001 distinct sizes: all tracked (1024 are)
    for i in range(odd):
        (d / page_name(i)).write_bytes(b"z" * (i + 1))
    for i in range(odd, 2 * odd + 1):
        (d / page_name(i)).write_bytes(b"z" * 5000)
    usage = scan_usage(layout, f"ns/{NS}")
    assert usage is not None and (usage.pages, usage.corrupt) == (2 * odd + 1, odd)


def test_sizes_past_1024_distinct_ones_are_counted_untracked(layout: Layout) -> None:
    d = ns_dir(layout)
    for i in range(1100):
        (d / page_name(i)).write_bytes(b"z" * (i + 1))
    ((_, _, files, nbytes, _, untracked, sizes),), _, _, _ = raw_scan(d)
    assert (files, len(sizes), untracked) == (1100, 1024, 76)
    assert nbytes == sum(range(1, 1101)) and sum(sizes.values()) + untracked == files
    usage = scan_usage(layout, f"ns/{NS}")
    assert usage is not None and usage.corrupt == 0  # no size is a majority: none called torn


def test_without_a_clear_majority_size_no_page_is_called_corrupt(layout: Layout) -> None:
    """As GC decides (gcfind.torn_pages): it would not know which pages to remove."""
    d = ns_dir(layout)
    for i in range(6):
        (d / page_name(i)).write_bytes(b"h" * (100 if i % 2 else 200))
    usage = scan_usage(layout, f"ns/{NS}")
    assert usage is not None and (usage.pages, usage.corrupt) == (6, 0)
    assert [usual_size({100: 3, 200: 3}, 6), usual_size({100: 4, 200: 2}, 6)] == [None, 100]
    assert [usual_size({0: 9, 5: 1}, 10), usual_size({7: 1}, 1)] == [None, None]


def test_more_entries_than_one_chunk_are_all_counted(layout: Layout) -> None:
    d = ns_dir(layout)
    n = 70_000  # the C side stats 65,536 names per round
    for i in range(n):
        os.close(os.open(d / page_name(i), os.O_CREAT | os.O_WRONLY, 0o644))
    (d / "stray").write_text("x")
    usage = scan_usage(layout, f"ns/{NS}")
    assert usage is not None and (usage.pages, usage.bytes, usage.other) == (n, 0, 1)
    assert usage.corrupt == 0  # empty files are never a page's usual size: none is "the" size
    assert usage.digest == reference(d).digest
    # one thread and many give the same groups
    one, many = raw_scan(d, 1), raw_scan(d, 16)
    assert sorted(one[0]) == sorted(many[0]) and one[1:] == many[1:]


def test_a_symlinked_directory_is_refused(layout: Layout, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / page_name(0)).write_bytes(b"x")
    (layout.ns_root / NS).symlink_to(elsewhere)
    with pytest.raises(UnsafePathError, match="symlink"):
        scan_usage(layout, f"ns/{NS}")


def test_bad_thread_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="threads"):
        _dirscan.scan(0, 0, RULES, FMT.classify)


_HEX = st.text("0123456789abcdef", min_size=0, max_size=140)
# a few keys, so that files of one page (pools, ranks) and keys that extend others meet
_KEYS = st.sampled_from(["a" * 16, "a" * 17, "f" * 64, "f" * 65, "0" * 128, "0" * 129])
_TAILS = st.sampled_from(
    [
        "_m_0_1.bin",
        ".mamba_m.bin",
        "_Qwen-Qwen3-8B.bin",
        ".bin",
        "_.bin",
        "_m_0_1.bin.tmp",
        ".swa_x_1_2_cp0_2.bin",
        "",
        "_m",
        "Z_m_0_1.bin",
        ".nopool_m.bin",
        "_m_1_2.bin",
        ".deepseek_v4_c4_indexer_state_m_0_1_2_1.bin",
        "_m_0_1.bin.tmp.12.345." + "c" * 32,
        "_m_0_1.bin.tmp.12.x." + "c" * 32,
    ]
)
_NAMES = st.one_of(
    st.builds(lambda h, t: h + t, _HEX, _TAILS),
    st.builds(lambda h, t: h + t, _KEYS, _TAILS),
    st.builds(lambda h: f".{h}.tmp", _HEX),
    st.text(st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1, max_size=60),
).filter(lambda n: n not in ("", ".", "..") and len(n.encode()) <= 255)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    names=st.sets(_NAMES, min_size=1, max_size=40), sizes=st.lists(st.integers(0, 3), min_size=1)
)
def test_any_names_classify_as_the_format_says(
    tmp_path: Path, names: set[str], sizes: list[int]
) -> None:
    """Grouping by shape never changes a verdict: the C scan agrees with the format's classify()
    per name, and counts the pages the format's keys make."""
    layout = Layout.at(Path(tempfile.mkdtemp(dir=tmp_path)))
    create_root(layout)
    d = ns_dir(layout)
    for i, name in enumerate(sorted(names)):
        (d / name).write_bytes(b"b" * sizes[i % len(sizes)])
    got = scan_usage(layout, f"ns/{NS}")
    assert got is not None
    want = reference(d)
    assert got == replace(want, corrupt=got.corrupt)
    # and the listings agree with classify() too, the temps-only one (a suffix filter) included
    temps = {f.name for f in list_files(layout, f"ns/{NS}", TEMPS)}
    assert temps == {n for n in names if FMT.classify(n) is FileKind.TEMP}
    listed = {f.name: f.key_len for f in list_files(layout, f"ns/{NS}")}
    assert listed == {
        n: FMT.key_len(n) or 0 for n in names if FMT.classify(n) is not FileKind.FOREIGN
    }


def test_list_files_gives_regular_pages_and_temps_with_size_and_mtime(layout: Layout) -> None:
    d = ns_dir(layout)
    (d / page_name(1)).write_bytes(b"p" * 10)
    os.utime(d / page_name(1), (1000.0, 1000.0))
    (d / f".{'b' * 32}.tmp").write_bytes(b"t")
    (d / "notes.txt").write_text("n")
    (d / page_name(2)).symlink_to(d / page_name(1))
    (d / page_name(3)).mkdir()
    got = {f.name: f for f in list_files(layout, f"ns/{NS}")}
    assert {(f.kind, f.name, f.size) for f in got.values()} == {
        (FileKind.PAGE, page_name(1), 10),
        (FileKind.TEMP, f".{'b' * 32}.tmp", 1),
    }
    assert got[page_name(1)].mtime == 1000.0
    assert list(list_files(layout, "ns/ffffffffffffffff")) == []


def test_the_files_of_one_page_count_once_and_their_bytes_all(layout: Layout) -> None:
    """SGLang's newer names: pool files and every rank's file share the page's key."""
    d = ns_dir(layout)
    key = "e" * 64
    names = [
        f"{key}_m_0_2.bin",
        f"{key}_m_1_2.bin",  # TP ranks 0 and 1
        f"{key}.mamba_m_0_2.bin",
        f"{key}.mamba_m_1_2.bin",  # their mamba pool's part
        f"{key}.deepseek_v4_c4_indexer_m_0_2_2_1_cp1_2.bin",  # PP and CP parts
        f"{'d' * 64}.swa_m_0_2.bin",  # a pool file whose KV file is gone: still a page
        f"{key}_m_0_2.bin.tmp.41.1399.{'a' * 32}",  # a write in progress (newer temp name)
    ]
    for n in names:
        (d / n).write_bytes(b"x" * 10)
    usage = scan_usage(layout, f"ns/{NS}")
    assert usage is not None
    assert (usage.pages, usage.files, usage.bytes, usage.temps) == (2, 6, 60, 1)
    assert usage == reference(d)


def test_a_classifier_that_raises_fails_the_scan(layout: Layout) -> None:
    d = ns_dir(layout)
    (d / page_name(0)).write_bytes(b"x")

    def broken(shape: str) -> int:
        raise RuntimeError(f"cannot classify {shape}")

    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(RuntimeError, match="cannot classify"):
            _dirscan.scan(fd, 2, RULES, broken)
    finally:
        os.close(fd)
