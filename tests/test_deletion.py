from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cachemgr.errors import UnsafePathError
from cachemgr.fs import deletion
from cachemgr.fs._unlink import unlink_batch
from cachemgr.fs.deletecheck import NOT_REACHED, STAT_ERROR, reason_of
from cachemgr.fs.deletion import PART, DeleteReport, Listeners, Pacer, delete_dir, delete_files
from cachemgr.sglang.hicache import HICACHE_FILE
from cachemgr.vllm.fstier import VLLM_FS_TIER
from tests.vllmtrees import write_blocks, write_folder

KEY = "ab" * 32
PAGES = [f"{KEY[:-2]}{i:02x}_m_0_1.bin" for i in range(5)]
TEMP = f".{'c' * 32}.tmp"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A root with one namespace of pages, a temp file, and things that must survive."""
    ns = tmp_path / "root" / "ns" / "0123456789abcdef"
    ns.mkdir(parents=True)
    for name in [*PAGES, TEMP]:
        (ns / name).write_bytes(b"x" * 100)
    (ns / "notes.txt").write_text("mine")
    return tmp_path / "root"


def test_deletes_pages_and_temps_only(tree: Path) -> None:
    names = sorted(os.listdir(tree / "ns" / "0123456789abcdef"))
    report = delete_files(tree, "ns/0123456789abcdef", names)
    assert report.files == 6
    assert report.bytes == 600
    assert os.listdir(tree / "ns" / "0123456789abcdef") == ["notes.txt"]
    assert report.refused == (
        "ns/0123456789abcdef/notes.txt: not a page or temp file name of SGLang HiCacheFile",
    )


def test_dry_run_deletes_nothing_and_counts_the_same(tree: Path) -> None:
    names = sorted(os.listdir(tree / "ns" / "0123456789abcdef"))
    dry = delete_files(tree, "ns/0123456789abcdef", names, dry_run=True)
    assert len(os.listdir(tree / "ns" / "0123456789abcdef")) == 7
    real = delete_files(tree, "ns/0123456789abcdef", names)
    assert (dry.files, dry.bytes) == (real.files, real.bytes)


def test_symlinked_page_name_is_not_followed(tree: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"precious")
    link = f"{'d' * 64}_m_0_1.bin"
    (tree / "ns" / "0123456789abcdef" / link).symlink_to(outside)
    report = delete_files(tree, "ns/0123456789abcdef", [link])
    assert report.files == 0
    assert report.refused == (f"ns/0123456789abcdef/{link}: not a regular file",)
    assert outside.read_bytes() == b"precious"


def test_symlinked_directory_on_the_way_is_refused(tree: Path, tmp_path: Path) -> None:
    victim = tmp_path / "elsewhere"
    victim.mkdir()
    (victim / PAGES[0]).write_bytes(b"keep")
    (tree / ".trash").mkdir()
    (tree / ".trash" / "0123456789abcdef.1").symlink_to(victim)
    with pytest.raises(UnsafePathError, match="symlink"):
        delete_dir(tree, ".trash/0123456789abcdef.1")
    with pytest.raises(UnsafePathError):
        delete_files(tree, ".trash/0123456789abcdef.1", [PAGES[0]])
    assert (victim / PAGES[0]).read_bytes() == b"keep"


@pytest.mark.parametrize("rel", ["../outside", "/etc", "ns/../..", "ns/x/../../.."])
def test_paths_leaving_the_root_are_refused(tree: Path, rel: str) -> None:
    with pytest.raises(UnsafePathError, match="not a plain path"):
        delete_files(tree, rel, PAGES)


def test_names_with_slashes_are_refused(tree: Path) -> None:
    report = delete_files(tree, "ns", ["0123456789abcdef/" + PAGES[0]])
    assert report.files == 0
    assert (tree / "ns" / "0123456789abcdef" / PAGES[0]).exists()


def test_directory_named_like_a_page_is_kept(tree: Path) -> None:
    odd = tree / "ns" / "0123456789abcdef" / f"{'e' * 64}_m_0_1.bin"
    odd.mkdir()
    report = delete_files(tree, "ns/0123456789abcdef", [odd.name])
    assert report.refused and odd.is_dir()


def test_young_files_are_kept(tree: Path) -> None:
    clock = [os.stat(tree / "ns" / "0123456789abcdef" / PAGES[0]).st_mtime + 5]
    report = delete_files(tree, "ns/0123456789abcdef", PAGES, min_age=60, now=lambda: clock[0])
    assert (report.files, report.young) == (0, 5)
    clock[0] += 3600
    report = delete_files(tree, "ns/0123456789abcdef", PAGES, min_age=60, now=lambda: clock[0])
    assert report.files == 5


def test_vanished_files_are_counted_not_errors(tree: Path) -> None:
    report = delete_files(tree, "ns/0123456789abcdef", ["f" * 64 + "_m_0_1.bin", PAGES[0]])
    assert (report.files, report.vanished) == (1, 1)


def test_delete_dir_removes_an_emptied_dir(tree: Path) -> None:
    (tree / "ns" / "0123456789abcdef" / "notes.txt").unlink()
    report = delete_dir(tree, "ns/0123456789abcdef")
    assert report.files == 6
    assert not (tree / "ns" / "0123456789abcdef").exists()


def test_delete_dir_keeps_a_dir_with_foreign_files(tree: Path) -> None:
    report = delete_dir(tree, "ns/0123456789abcdef")
    assert report.files == 6
    assert os.listdir(tree / "ns" / "0123456789abcdef") == ["notes.txt"]


def test_pacer_sleeps_to_hold_the_rate() -> None:
    slept: list[float] = []
    now = [0.0]
    pacer = Pacer(rate=100, batch=10, sleep=slept.append, clock=lambda: now[0])
    for _ in range(30):
        pacer.tick()
    # 30 files at 100/s take 0.3 s: with a frozen clock each batch of 10 waits its 0.1 s share
    assert slept == pytest.approx([0.1, 0.2, 0.3])


def _mixed_dir(ns: Path, outside: Path, n: int) -> tuple[set[str], set[str]]:
    """n pages across several parts, with a link, a dir, a FIFO and a foreign file named among
    them; (names to delete, names that must stay)."""
    pages = {f"{i:064x}_m_0_1.bin" for i in range(n)}
    for name in pages:
        (ns / name).write_bytes(b"p" * 10)
    link, a_dir, fifo = (f"{'e' * 63}{c}_m_0_1.bin" for c in "012")
    (ns / link).symlink_to(outside)
    (ns / a_dir).mkdir()
    os.mkfifo(ns / fifo)
    return pages, {link, a_dir, fifo, "notes.txt"}


def test_unpaced_parts_on_threads_delete_exactly_what_the_dry_run_counts(
    tree: Path, tmp_path: Path
) -> None:
    """Several parts, unlinked on several threads: each file still gets every check, and the
    dry run counts what the real run then deletes."""
    ns = tree / "ns" / "0123456789abcdef"
    for name in [*PAGES, TEMP]:
        (ns / name).unlink()
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"precious")
    pages, stay = _mixed_dir(ns, outside, 3 * PART + 17)
    names = sorted(pages | stay)
    dry = delete_files(tree, "ns/0123456789abcdef", names, dry_run=True)
    gone: dict[str, int | None] = {}
    real = delete_files(
        tree, "ns/0123456789abcdef", names, listeners=Listeners(removed=gone.__setitem__)
    )
    assert (dry.files, dry.bytes) == (real.files, real.bytes) == (len(pages), 10 * len(pages))
    assert set(os.listdir(ns)) == stay and set(gone) == pages
    assert sorted(real.refused) == sorted(dry.refused) and len(real.refused) == 4
    assert outside.read_bytes() == b"precious"


def test_an_unlink_the_kernel_refuses_is_a_permission_refusal(tree: Path) -> None:
    """An unlink refused by the kernel (an immutable file, EPERM even for root) keeps that
    file, reported as a `permission` refusal; the others go and `removed` hears each."""
    ns = tree / "ns" / "0123456789abcdef"
    stuck = ns / PAGES[2]
    subprocess.run(["chattr", "+i", str(stuck)], check=True)
    gone: dict[str, int | None] = {}
    try:
        report = delete_files(
            tree,
            "ns/0123456789abcdef",
            [*PAGES, TEMP],
            listeners=Listeners(removed=gone.__setitem__),
        )
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
    left = set(os.listdir(ns))
    assert PAGES[2] in left
    assert set(gone) == {*PAGES, TEMP} - left  # every file gone was reported, no other
    assert [reason_of(r) for r in report.refused] == ["permission"]
    assert PAGES[2] in report.refused[0] and "Operation not permitted" in report.refused[0]


def test_threads_stop_before_any_unlink_once_the_dir_left_its_parent(tree: Path) -> None:
    """The C batch's location guard: with the parent's entry no longer this dir, no thread
    unlinks anything and every name is reported not reached."""
    ns = tree / "ns" / "0123456789abcdef"
    dir_fd = os.open(ns, os.O_RDONLY | os.O_DIRECTORY)
    parent_fd = os.open(tree / "ns", os.O_RDONLY | os.O_DIRECTORY)
    try:
        other = os.stat(tree)  # the entry must be (dev, inode) of ns/<id>; this is not it
        results, moved = unlink_batch(
            dir_fd, parent_fd, ns.name, other.st_dev, other.st_ino, PAGES, 0.0, 0.0, 8, 0, False
        )
    finally:
        os.close(dir_fd)
        os.close(parent_fd)
    assert moved and {s for s, _ in results} == {NOT_REACHED}
    assert set(PAGES) <= set(os.listdir(ns))


def test_a_name_with_a_nul_never_reaches_the_shorter_name(tree: Path) -> None:
    """The kernel would read "page\\0x" as "page": the C batch refuses such a name outright."""
    ns = tree / "ns" / "0123456789abcdef"
    fd = os.open(ns, os.O_RDONLY | os.O_DIRECTORY)
    try:
        results, _ = unlink_batch(fd, -1, "", 0, 0, [PAGES[0] + "\0x"], 0.0, 0.0, 1, 0, False)
    finally:
        os.close(fd)
    assert results == [(STAT_ERROR, errno.EINVAL)] and (ns / PAGES[0]).exists()


def test_a_name_given_twice_is_deleted_once_and_counted_once(tree: Path) -> None:
    report = delete_files(tree, "ns/0123456789abcdef", [PAGES[0], PAGES[1], PAGES[0]])
    assert (report.files, report.bytes, report.vanished) == (2, 200, 1)


@pytest.mark.parametrize("layout", ["sglang", "vllm"])
def test_a_stop_ends_a_dir_deletion_after_the_part_under_way(tmp_path: Path, layout: str) -> None:
    """At most a part (PART files) goes after a stop, in a flat dir or a nested format's
    hashed dirs (whose parts were 8 times larger when unpaced: a leader woken without the
    lease unlinked 2,048 blocks late)."""
    entry = tmp_path / "root" / ".trash" / "0123456789abcdef.1"
    entry.mkdir(parents=True)
    if layout == "sglang":
        fmt = HICACHE_FILE
        for name in [f"{i:064x}_m_0_1.bin" for i in range(3 * PART)]:
            (entry / name).write_bytes(b"x")
    else:
        fmt = VLLM_FS_TIER
        write_blocks(entry, write_folder(entry), 3 * PART, size=1)
    asked: list[bool] = []

    def stop() -> bool:  # yes from the second part on (a GC lease lost meanwhile)
        asked.append(len(asked) >= 1)
        return asked[-1]

    report = delete_dir(
        tmp_path / "root", ".trash/0123456789abcdef.1", fmt=fmt, listeners=Listeners(stop=stop)
    )
    assert (report.files, report.stopped, report.refused) == (PART, True, ())
    left = [f for _, _, files in os.walk(entry) for f in files if f.endswith(".bin")]
    assert len(left) == 2 * PART  # the rest, and the dir, stay for the next drain


@pytest.mark.parametrize("layout", ["sglang", "vllm"])
def test_delete_dir_lists_a_big_dir_a_chunk_at_a_time_and_empties_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """A purged dir of ten million files is not listed as one list (a gigabyte, held before
    the first unlink): chunks of LISTED names, each deleted before the next is listed. All
    of them go, the dry run says the same, and a foreign file still keeps the dir."""
    monkeypatch.setattr(deletion, "LISTED", 7)
    root = tmp_path / "root"
    entry = root / ".trash" / "0123456789abcdef.1"
    entry.mkdir(parents=True)
    if layout == "sglang":
        fmt, names = HICACHE_FILE, [f"{i:064x}_m_0_1.bin" for i in range(100)]
        for name in names:
            (entry / name).write_bytes(b"x" * 10)
    else:
        fmt, folder = VLLM_FS_TIER, write_folder(entry)
        names = write_blocks(entry, folder, 100, size=10)
    chunks: list[int] = []
    real = deletion.delete_files

    def counting(*args: Any, **kw: Any) -> DeleteReport:
        chunks.append(len(args[2]))
        return real(*args, **kw)

    monkeypatch.setattr(deletion, "delete_files", counting)
    dry = delete_dir(root, ".trash/0123456789abcdef.1", fmt=fmt, dry_run=True)
    assert max(chunks) <= 7 and sum(chunks) >= 100
    (entry / ("zz" + names[0].rpartition("/")[2] + ".keep")).write_text("a person's")
    told: list[tuple[int, int]] = []
    heard = Listeners(progress=lambda files, size: told.append((files, size)))
    report = delete_dir(root, ".trash/0123456789abcdef.1", fmt=fmt, listeners=heard)
    assert (dry.files, dry.bytes) == (report.files, report.bytes) == (100, 1000)
    assert told == sorted(told) and told[-1] == (100, 1000)  # running totals, not a chunk's
    assert len(report.refused) == 1 and entry.is_dir()  # the foreign file keeps the dir
    (entry / ("zz" + names[0].rpartition("/")[2] + ".keep")).unlink()
    assert delete_dir(root, ".trash/0123456789abcdef.1", fmt=fmt).files == 0
    assert not entry.exists()  # emptied: its dirs and the entry go


def test_a_hard_linked_page_is_deleted_and_frees_nothing(tree: Path, tmp_path: Path) -> None:
    """A page with another name (an operator's `cp -al` backup on the same filesystem) goes
    from the cache, but its bytes and inode stay in use: the report counts it deleted and
    linked, and not in the bytes freed; a dry run says the same."""
    ns = tree / "ns" / "0123456789abcdef"
    backup = tmp_path / "backup"
    backup.mkdir()
    os.link(ns / PAGES[0], backup / PAGES[0])
    dry = delete_files(tree, "ns/0123456789abcdef", PAGES[:2], dry_run=True)
    report = delete_files(tree, "ns/0123456789abcdef", PAGES[:2])
    for r in (dry, report):
        assert (r.files, r.bytes, r.linked, r.linked_bytes) == (2, 100, 1, 100)
    assert not (ns / PAGES[0]).exists() and (backup / PAGES[0]).stat().st_nlink == 1
