"""An inode-starved filesystem (issue 23): an ext4 of 3,000 inodes and plenty of bytes, the
daemon on its defaults (the inode floor at 5%), and an SGLang-style writer (a temp file, then a
rename) storing 20,000 pages at about 1,000 a second: it must see no ENOSPC."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.settings import Settings, load_settings
from tests.daemon_helpers import NS_A, page_name, register_namespace, running_daemon

PAGES = 20_000
RATE = 1000.0  # pages a second


@pytest.fixture
def few_inodes(tmp_path: Path) -> Iterator[Path]:
    """A 256 MiB ext4 with 3,000 inodes (small pages inline in them), loop-mounted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a loop filesystem needs root (CI runs as root)")
    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(256 << 20)
    subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-m", "0", "-N", "3000", "-O", "inline_data", str(image)],
        check=True,
    )
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def store_like_sglang(d: Path, i: int) -> bool:
    """One page as HiCacheFile stores it; False if the filesystem said ENOSPC."""
    tmp = d / f".{uuid.uuid4().hex}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, b"\x05" * 48)
        finally:
            os.close(fd)
        os.replace(tmp, d / page_name(i))
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        tmp.unlink(missing_ok=True)
        return False
    return True


def test_a_writer_on_3000_inodes_sees_no_enospc(few_inodes: Path) -> None:
    layout = Layout.at(few_inodes / "root")
    create_root(layout)
    d = register_namespace(layout, NS_A, instance="gpu0")
    total = os.statvfs(few_inodes).f_files
    assert total < 3100
    # The daemon on defaults: the inode floor's own default, not the suite's 0 (conftest).
    floor = Settings.model_fields["gc_min_free_inodes_percent"].default
    settings = load_settings(
        root=layout.root, gc_min_age=0, gc_min_free_inodes_percent=floor, log_format="json"
    )
    failed = 0
    with running_daemon(settings):
        t0 = time.monotonic()
        for i in range(PAGES):
            failed += not store_like_sglang(d, i)
            ahead = t0 + (i + 1) / RATE - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
        took = time.monotonic() - t0
    assert took < PAGES / RATE * 3, "the writer could not keep its pace"
    assert failed == 0, f"{failed} of {PAGES} stores failed with ENOSPC ({took:.0f} s)"


def test_doctor_says_what_gc_cannot_hold_when_other_files_hold_the_inodes(
    few_inodes: Path,
) -> None:
    """`cachemgr gc` exits 1 ("`cachemgr doctor` says how to fix it") when files outside the
    cache leave fewer inodes free than the floor; doctor checked bytes only and said "no
    problems found", exit 0."""
    layout = Layout.at(few_inodes / "root")
    create_root(layout)
    d = register_namespace(layout, NS_A, instance="gpu0")
    for i in range(20):
        store_like_sglang(d, i)
    other = few_inodes / "other"
    other.mkdir()
    floor = Settings.model_fields["gc_min_free_inodes_percent"].default
    keep = os.statvfs(few_inodes).f_files * floor / 100 / 2  # half the floor left free
    i = 0
    while os.statvfs(few_inodes).f_favail > keep:
        (other / str(i)).touch()
        i += 1
    env = {**os.environ, "CACHEMGR_GC_MIN_FREE_INODES_PERCENT": str(floor)}
    cli = [sys.executable, "-m", "cachemgr", "--root", str(layout.root)]
    gc = subprocess.run([*cli, "gc", "--yes"], capture_output=True, text=True, env=env)
    assert gc.returncode == 1 and "cachemgr doctor" in gc.stderr, (gc.stdout, gc.stderr)
    doctor = subprocess.run([*cli, "doctor", "--json"], capture_output=True, text=True, env=env)
    assert doctor.returncode == 2, (doctor.stdout, doctor.stderr)
    (found,) = [f for f in json.loads(doctor.stdout) if f["code"] == "inodes-full"]
    assert "inodes free of" in found["message"] and "gc_min_free_inodes_percent" in found["fix"]


def test_the_daemon_starts_on_a_root_with_no_inode_left(few_inodes: Path) -> None:
    """A daemon stopped cleanly (SQLite removes its -wal and -shm) while a writer used every
    inode: SQLite cannot create them and says "unable to open database file", which was not
    read as a full filesystem, so `serve` exited 2 at every start and GC never ran; the start
    now runs the floor pass from a scan of the disk, then opens the DB."""
    layout = Layout.at(few_inodes / "root")
    create_root(layout)
    d = register_namespace(layout, NS_A, instance="gpu0")
    i = 0
    while store_like_sglang(d, i):
        i += 1
    assert os.statvfs(few_inodes).f_favail == 0
    floor = Settings.model_fields["gc_min_free_inodes_percent"].default
    settings = load_settings(root=layout.root, gc_min_age=0, gc_min_free_inodes_percent=floor)
    with running_daemon(settings) as running:
        assert running.http.get("/readyz").status_code == 200
    st = os.statvfs(few_inodes)
    assert st.f_favail >= st.f_files * floor / 100


def _fill_until(d: Path, free: int) -> None:
    """SGLang-style stores (young pages) until `free` inodes or fewer are left."""
    i = 0
    while os.statvfs(d).f_favail > free and store_like_sglang(d, i):
        i += 1


def test_a_floor_the_run_holds_with_young_pages_is_held(few_inodes: Path) -> None:
    """Under the inode floor with every page younger than gc_min_age, the floor pass (which
    keeps min_age) deletes none and says the floor unmet; the run after it takes the young
    pages, as a limit wins over min_age, and holds it. The pass's word stood: `gc` exited 1
    ("the limit was not held") and the daemon counted a `short` run for a floor it held."""
    layout = Layout.at(few_inodes / "root")
    create_root(layout)
    d = register_namespace(layout, NS_A, instance="gpu0")
    _fill_until(d, 50)  # under the 5% floor (150 of 3,000), with room for the DB's files
    floor = Settings.model_fields["gc_min_free_inodes_percent"].default
    env = {**os.environ, "CACHEMGR_GC_MIN_FREE_INODES_PERCENT": str(floor)}
    cli = [sys.executable, "-m", "cachemgr", "--root", str(layout.root)]
    gc = subprocess.run(
        [*cli, "gc", "--yes", "--json", "--min-age", "1h"], capture_output=True, text=True, env=env
    )
    assert gc.returncode == 0, (gc.stdout, gc.stderr)
    report = json.loads(gc.stdout)
    assert report["held"] and not report["unmet"], report
    # nor a line of the pass's saying it fell short (the run's word is the later one)
    assert not [w for w in report["warnings"] if "short of" in w], report["warnings"]
    assert os.statvfs(few_inodes).f_favail > os.statvfs(few_inodes).f_files * floor / 100


def test_with_no_inode_left_and_every_page_young_gc_and_the_daemon_free_some(
    few_inodes: Path,
) -> None:
    """0 inodes left, every page younger than gc_min_age, the DB's -wal and -shm gone (a
    clean stop): the floor pass keeps young pages, so the DB still cannot open and the run
    that would take them never came. `gc --yes` exited 2 naming itself as the fix, and the
    daemon exited 2 at every start until the pages aged; both now take the young pages."""
    layout = Layout.at(few_inodes / "root")
    create_root(layout)
    d = register_namespace(layout, NS_A, instance="gpu0")
    _fill_until(d, 0)
    assert os.statvfs(few_inodes).f_favail == 0
    floor = Settings.model_fields["gc_min_free_inodes_percent"].default
    env = {**os.environ, "CACHEMGR_GC_MIN_FREE_INODES_PERCENT": str(floor)}
    cli = [sys.executable, "-m", "cachemgr", "--root", str(layout.root)]
    gc = subprocess.run(
        [*cli, "gc", "--yes", "--min-age", "1h"], capture_output=True, text=True, env=env
    )
    assert gc.returncode == 0, (gc.stdout, gc.stderr)
    assert os.statvfs(few_inodes).f_favail >= os.statvfs(few_inodes).f_files * floor / 100
    _fill_until(d, 0)
    settings = load_settings(root=layout.root, gc_min_age="1h", gc_min_free_inodes_percent=floor)
    with running_daemon(settings) as running:
        assert running.http.get("/readyz").status_code == 200
    assert os.statvfs(few_inodes).f_favail >= os.statvfs(few_inodes).f_files * floor / 100
