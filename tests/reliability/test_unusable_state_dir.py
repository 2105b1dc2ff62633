"""A state dir the daemon cannot use (chmod 000 while it runs) is not an unusable root: the
pages and ns/ are there and SGLang keeps serving them; the index, GC and purge wait for the
DB. It is said as what it is: the state dir (log, /readyz, cachemgr_state_dir_unusable),
never as `root unusable` / cachemgr_root_unusable, which say ns/ cannot be listed.

Bound by mode bits as test_unusable_ns's daemon is.
"""

from __future__ import annotations

import time
from pathlib import Path

from cachemgr.layout import Layout
from tests.daemon_helpers import NS_A, page_name, store_page
from tests.polling import wait_for
from tests.reliability.test_unusable_ns import base, daemon, lines

__all__ = ["base"]  # the fixture, used by name


def test_an_unusable_state_dir_is_said_as_such_not_as_the_root(base: Path, free_port: int) -> None:
    layout = Layout.at(base / "root")
    log = base / "daemon.log"
    with daemon(layout.root, free_port, log) as d:
        layout.state_dir.chmod(0o000)
        try:
            store_page(layout.ns_dir(NS_A), page_name(1))  # an index write that must wait
            wait_for(
                lambda: d.metric("cachemgr_state_dir_unusable"),
                lambda v: v == 1,
                timeout=30,
                what="cachemgr_state_dir_unusable 1",
            )
            for _ in range(3):  # over the 5 s retries: never the root
                assert d.metric("cachemgr_root_unusable") == 0
                detail = d.http.get("/readyz").json()["detail"]
                assert "root unreadable" not in detail, detail
                assert str(layout.state_dir) in detail, detail
                time.sleep(2.5)
        finally:
            layout.state_dir.chmod(0o755)
        wait_for(
            lambda: d.metric("cachemgr_state_dir_unusable"),
            lambda v: v == 0,
            timeout=30,
            what="cachemgr_state_dir_unusable back to 0",
        )
        assert d.alive()
    assert not lines(log, "root unusable; the daemon waits for it")
    assert lines(log, "state dir unusable; the daemon waits for it")
