"""GC's drop of an unbound namespace renames its dir into .trash/ and then commits the rows
that say so, its `evict` audit row among them: killed (kill -9) between the two, the row was
lost while the drain deleted the pages later. It records its intent first, as a purge does
(cachemgr.ns.purge_intent), and the row is written once, by whoever settles that intent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from cachemgr.layout import Layout
from cachemgr.settings import Settings
from cachemgr.state.store import Store
from tests.daemon_helpers import running_daemon
from tests.nsfixtures import PAGE_BYTES, audit_rows, cli, make_ns
from tests.polling import wait_for

# `cachemgr gc` as the CLI runs it, in a process of its own, with every unbound namespace past
# retention, killed (SIGKILL, by itself: no handler, no finally runs) at the drop's rename
# into .trash/, just before or just after it.
_KILLED_DROP = """
import os, runpy, signal, sys
when, ns, root = sys.argv[1:4]
real = os.rename

def move(*args, **kw):
    if not str(args[1]).startswith(ns + "."):
        return real(*args, **kw)
    if when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    real(*args, **kw)
    os.kill(os.getpid(), signal.SIGKILL)

os.rename = move
sys.argv = ["cachemgr", "--root", root, "gc", "--yes"]
runpy.run_module("cachemgr", run_name="__main__")
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_gc_drop_killed_at_its_rename_is_audited_once_if_it_moved(
    layout: Layout, store: Store, settings: Settings, when: str
) -> None:
    """kill -9 right after the drop's rename, before its transaction commits: the trash entry
    is drained later (the daemon's GC at its start), and its `evict` row is written then,
    once; a later purge does not write it again. Killed right before the rename, nothing
    moved: no eviction is audited, then or later."""
    ns = make_ns(layout, store, "a", pages=3)
    other = make_ns(layout, store, "b", pages=1)
    script = [sys.executable, "-c", _KILLED_DROP, when, ns, str(layout.root)]
    env = {**os.environ, "CACHEMGR_GC_KEEP_UNBOUND": "0", "CACHEMGR_GC_MIN_AGE": "0"}
    proc = subprocess.run(script, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    moved = when == "after"
    assert bool(os.listdir(layout.trash)) == moved
    assert audit_rows(store, "evict", ns) == []  # its transaction never committed
    with running_daemon(settings):  # (keeps 2 unbound namespaces: drops neither)
        wait_for(lambda: os.listdir(layout.trash), lambda left: left == [], timeout=30)
    audited = [("unbound", "cli", 3, 3 * PAGE_BYTES)] if moved else []
    assert audit_rows(store, "evict", ns) == audited
    assert cli("--root", str(layout.root), "purge", "--namespace", other, "--yes").returncode == 0
    assert audit_rows(store, "evict", ns) == audited
    if not moved:  # the namespace is as it was
        assert len(os.listdir(layout.ns_dir(ns))) == 3
