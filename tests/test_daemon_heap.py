"""While it serves, the daemon leaves what it built at start-up out of the garbage collector's
full collections (cachemgr.daemon.heap): each one traverses every object it tracks in one C
call that holds the GIL while a /metrics scrape waits, and a mass eviction triggers several;
and it hands the GIL over every ms, not every 5. Stopping it undoes both. It also holds
malloc's trim threshold, so that a thread's arena gives its freed top back."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from cachemgr.daemon import heap
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from tests.daemon_helpers import NS_A, page_name, register_namespace, running_daemon, store_page


def test_a_serving_daemon_keeps_start_up_objects_out_of_full_collections(
    tmp_path: Path,
) -> None:
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    store_page(register_namespace(layout, NS_A, instance="gpu0"), page_name(0))
    before = sys.getswitchinterval()
    with running_daemon(load_settings(root=layout.root)) as dm:
        assert dm.get("/metrics").status_code == 200
        assert sys.getswitchinterval() == 0.001
        tracked = gc.get_objects()  # what a full collection would traverse (not the frozen)
        assert not any(o is dm.daemon.app or o is dm.daemon.gc for o in tracked)
        assert gc.get_freeze_count() > len(tracked)
        del tracked
    assert gc.get_freeze_count() == 0  # stopped: all of it is the collector's again
    assert sys.getswitchinterval() == before


def test_a_daemon_stopping_leaves_another_one_serving_as_it_was(tmp_path: Path) -> None:
    """Two daemons in one process (as in tests, or an embedding): the first to stop must not
    take the 1 ms switch interval and the frozen start-up objects from the one still serving;
    the last to stop gives both back."""
    before = sys.getswitchinterval()
    roots = []
    for name in ("a", "b"):
        layout = Layout.at(tmp_path / name)
        create_root(layout)
        store_page(register_namespace(layout, NS_A, instance="gpu0"), page_name(0))
        roots.append(layout.root)
    with running_daemon(load_settings(root=roots[0])) as first:
        with running_daemon(load_settings(root=roots[1])) as second:
            assert second.get("/metrics").status_code == 200
        assert first.get("/metrics").status_code == 200
        assert sys.getswitchinterval() == 0.001
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    assert sys.getswitchinterval() == before


# In a fresh process (the threshold, once held, stays held): a large block freed (it raises
# glibc's sliding thresholds), then a thread allocates 32 MiB in 16 KiB blocks and frees them;
# prints the MiB of RSS they left.
_ARENA_TOP = """
import sys, threading
from cachemgr.daemon import heap

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

if sys.argv[1] == "serving":
    heap.start_serving()
big = bytearray(30 << 20)
del big
left = []

def work():
    blocks = [bytearray(16 << 10) for _ in range(2048)]
    before = rss()
    del blocks
    heap.trim()
    left.append(32 - (before - rss()))

t = threading.Thread(target=work)
t.start()
t.join()
print(left[0])
"""


@pytest.mark.skipif(heap._MALLOPT is None, reason="glibc's malloc only")
def test_a_serving_daemon_gives_back_what_a_thread_freed_at_its_arenas_top() -> None:
    def left(mode: str) -> float:
        argv = [sys.executable, "-c", _ARENA_TOP, mode]
        return float(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)

    assert left("serving") < 4
    assert left("not serving") > 24  # (what the threshold held gives back: malloc_trim cannot)
