"""While it serves, the daemon leaves what it built at start-up out of the garbage collector's
full collections (cachemgr.daemon.heap): each one traverses every object it tracks in one C
call that holds the GIL while a /metrics scrape waits, and a mass eviction triggers several;
and it hands the GIL over every ms, not every 5. Stopping it undoes both."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

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
