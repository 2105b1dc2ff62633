"""Pages with another hard link (an operator's `cp -al` backup of the cache on the same
filesystem): deleting one removes the cache's page and frees no byte and no inode. GC says
exactly that: the bytes it reports freed (log, audit, `cachemgr gc`'s table) leave them out, and
a floor they were counted toward is not said held. A real ext4, loop-mounted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from cachemgr.fs.root import create_root
from cachemgr.gc.floor import free_floor
from cachemgr.layout import Layout
from cachemgr.state.store import Store
from tests.daemon_helpers import NS_A, page_name, register_namespace
from tests.gc_helpers import policy

PAGE = 1 << 20
OLD = 1_000_000_000.0


def _cache(mnt: Path, pages: int) -> tuple[Layout, Path]:
    """A root on `mnt` with `pages` old 1 MiB pages in one namespace."""
    layout = Layout.at(mnt / "root")
    create_root(layout)
    d = register_namespace(layout, NS_A, instance="gpu0")
    for i in range(pages):
        p = d / page_name(i)
        p.write_bytes(os.urandom(PAGE))
        os.utime(p, (OLD + i, OLD + i))
    return layout, d


def _free(mnt: Path) -> int:
    st = os.statvfs(mnt)
    return st.f_bavail * st.f_frsize


def test_the_floor_pass_takes_no_hard_linked_page_for_space_it_does_not_free(
    small_fs: Path,
) -> None:
    """The pass deleted the linked pages oldest first and logged `held`, with their bytes as
    freed, while the filesystem had not one byte more: it now leaves them and deletes the
    pages whose deletion frees space, and says what it freed."""
    layout, d = _cache(small_fs, 40)
    backup = small_fs / "backup"
    backup.mkdir()
    for i in range(20):  # the older half has a second name
        os.link(d / page_name(i), backup / page_name(i))
    floor = _free(small_fs) + 10 * PAGE
    before = _free(small_fs)
    report = free_floor(layout, policy(min_free_bytes=floor), disk_usage=shutil.disk_usage)
    freed = _free(small_fs) - before
    assert report.files > 0 and report.bytes > 0
    assert report.bytes <= freed
    assert all((d / page_name(i)).exists() for i in range(20))
    assert report.held and _free(small_fs) >= floor


def test_a_floor_only_hard_links_could_meet_is_not_held(small_fs: Path) -> None:
    layout, d = _cache(small_fs, 40)
    subprocess.run(["cp", "-al", str(d), str(small_fs / "backup")], check=True)
    floor = _free(small_fs) + 10 * PAGE
    report = free_floor(layout, policy(min_free_bytes=floor), disk_usage=shutil.disk_usage)
    assert (report.files, report.bytes) == (0, 0)
    assert not report.held
    (unmet,) = report.unmet
    assert unmet.reason == "free_space" and "40 pages are hard links" in unmet.line()


def test_cachemgr_gc_reports_no_bytes_freed_for_hard_linked_pages(small_fs: Path) -> None:
    """The run after the pass evicts by the index, which knows no links: what it deleted
    freed nothing, and its table, log, audit and exit status say so."""
    layout, d = _cache(small_fs, 40)
    subprocess.run(["cp", "-al", str(d), str(small_fs / "backup")], check=True)
    env = {
        **os.environ,
        "CACHEMGR_GC_MIN_FREE_BYTES": str(_free(small_fs) + 10 * PAGE),
        "CACHEMGR_GC_MIN_AGE": "0",
        "CACHEMGR_LOG_FORMAT": "json",
    }
    cli = [sys.executable, "-m", "cachemgr", "--root", str(layout.root)]
    gc = subprocess.run([*cli, "gc", "--yes"], capture_output=True, text=True, env=env)
    assert gc.returncode == 1, (gc.stdout, gc.stderr)
    assert gc.stdout.startswith("deleted ") and ", 0 B\n" in gc.stdout, gc.stdout
    assert "were hard links another name keeps" in gc.stderr
    done = [json.loads(line) for line in gc.stderr.splitlines() if line.startswith("{")]
    (run,) = [r for r in done if r["msg"] == "gc done"]
    assert run["files"] > 0 and run["bytes"] == 0 and not run["held"]
    store = Store.open(layout.db_path)
    try:
        rows = store.conn.execute("SELECT pages, bytes FROM audit WHERE action = 'evict'")
        audited = rows.fetchall()
    finally:
        store.close()
    assert audited and all(size == 0 for _, size in audited)
