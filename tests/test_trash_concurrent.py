"""Two drains of one trash entry at once. In a fleet only the GC leader's daemon drains .trash/
(a follower's GC does not lead), but a `cachemgr purge` or `init` on any node drains what it
renamed in the foreground while the leader's GC finds the same entry, and a leader that lost
its lease finishes the part of the entry it was deleting (fenced per part of 256 files) while
the next one starts on it; on one node, a CLI purge and the daemon's GC do the same.

Each drain unlinks only what is still there, so no file is counted twice. But the slower one
used to end with a false `moved or replaced while its files were deleted` refusal (an error
line, a refused-file metric, `purge` exiting 1) once the faster one removed the emptied dir,
and with vLLM's nested layout it lost what it had deleted (no count, no audit row): deletions
that were never recorded. Here: the nodes are bindfs mounts of one dir (tests/fleet_bed.py),
each drain has its own state DB, as each node has.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cachemgr.fs.deletion import DeleteReport, Pacer
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.ns.purge import drain_trash
from cachemgr.state.store import Store
from tests.daemon_helpers import NS_A, page_name
from tests.fleet_bed import bindfs_nodes, need_binaries
from tests.polling import wait_for
from tests.vllmtrees import write_blocks, write_folder

FILES = 600
# Files/s of the drain the other one overtakes: it deletes one batch of 256 (Pacer.batch) at
# once, then sleeps 1.3 s, in which the other deletes the rest and removes the dir.
SLOW_RATE = 200.0


def _sglang_entry(entry: Path) -> None:
    entry.mkdir()
    for i in range(FILES):
        (entry / page_name(i)).write_bytes(b"p" * 100)


def _vllm_entry(entry: Path) -> None:
    write_blocks(entry, write_folder(entry), FILES, size=100, mtime=1e9)


@contextmanager
def _roots(tmp_path: Path, nodes: str) -> Iterator[tuple[Path, Path]]:
    """The root as the two drains reach it: one path, or two nodes' mounts of one dir."""
    if nodes == "one-node":
        yield tmp_path / "root", tmp_path / "root"
        return
    need_binaries()
    with bindfs_nodes(tmp_path / "root", tmp_path / "mnt", 2) as (a, b):
        yield a, b


def _files(entry: Path) -> int:
    return sum(1 for _ in entry.rglob("*.bin"))


def _audited(store: Store) -> int:
    row = store.conn.execute(
        "SELECT coalesce(sum(pages), 0) FROM audit WHERE action = 'delete-trash'"
    ).fetchone()
    return int(row[0])


@pytest.mark.parametrize("write", [_sglang_entry, _vllm_entry], ids=["sglang", "vllm"])
@pytest.mark.parametrize("nodes", ["one-node", "two-nodes"])
def test_two_drains_of_one_trash_entry_count_and_audit_each_file_once(
    tmp_path: Path, nodes: str, write: Callable[[Path], None]
) -> None:
    (tmp_path / "root").mkdir()
    with _roots(tmp_path, nodes) as (root_a, root_b):
        layouts = [Layout.at(root_a, tmp_path / "state-a"), Layout.at(root_b, tmp_path / "state-b")]
        for layout in layouts:
            create_root(layout)
        backing = tmp_path / "root" / ".trash" / f"{NS_A}.k3j2h1"
        write(backing)  # (not through a FUSE mount: faster)
        reports: list[DeleteReport] = []

        def slow_drain(store: Store) -> None:
            reports.append(drain_trash(layouts[0], store, actor="cli", pacer=Pacer(SLOW_RATE)))

        with Store.open(layouts[0].db_path) as a, Store.open(layouts[1].db_path) as b:
            slow = threading.Thread(target=slow_drain, args=(a,))
            slow.start()
            try:
                wait_for(lambda: _files(backing), lambda n: n < FILES, what="the slow drain")
                fast = drain_trash(layouts[1], b, actor="auto")  # overtakes it, removes the dir
            finally:
                slow.join(60)
            (slow_report,) = reports
            audited = (_audited(a), _audited(b))
        assert not backing.exists()
        assert slow_report.files > 0 and fast.files > 0, (slow_report, fast)  # both deleted
        assert slow_report.refused == () and fast.refused == (), (slow_report, fast)
        assert slow_report.files + fast.files == FILES, (slow_report, fast)
        assert audited == (slow_report.files, fast.files)
