"""Which daemon writes the index when several serve one root.

Several daemons may serve one root (one sidecar per server on a shared cache dir). Per kernel
(inotify reports what happens on this kernel: pods on one node share it, hosts sharing the root
over NFS do not) only the daemon holding <state_dir>/index-<boot id>.lock watches and writes
the index; the others *follow*: they serve the shared DB, count no events (counted twice,
every read would be), are ready while the leader's `.ready` marker exists, and try the lock
every batch interval. One that takes over rescans first (cheap when the index still matches
the disk: cachemgr.state.index) to catch what happened while nobody watched.
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import suppress
from pathlib import Path

from cachemgr.daemon.index_state import IndexState
from cachemgr.fs.leadership import Leadership
from cachemgr.fs.safe import open_dir, open_file

log = logging.getLogger(__name__)


def lead(
    leadership: Leadership | None,
    ready_marker: Path | None,
    state: IndexState,
    *,
    stopping: threading.Event,
    interval: float,
) -> bool:
    """Wait until this process leads the index (or `stopping` is set); True if it took over
    from another leader, whose last events nobody applied."""
    if leadership is None or leadership.try_acquire():
        state.leader = True
        return False
    log.info(
        "another daemon indexes this root; following it", extra={"holder": leadership.holder()}
    )
    while True:
        # Ready while the leader's index is built and live: it marks that with a file.
        state.live(ready_marker is not None and ready_marker.exists())
        if stopping.wait(interval):
            return False
        if leadership.try_acquire():
            log.warning("the indexing daemon is gone; taking over the index")
            state.live(False)  # until this process's own rescan is done
            state.leader = True
            return True


def mark_ready(marker: Path | None, ready: bool) -> None:
    """Create (ready) or remove the leader's ready marker; None: no followers to tell."""
    if marker is None:
        return
    if ready:  # created new: the unlink at start took away whatever was planted there
        os.close(open_file(marker, os.O_WRONLY | os.O_CREAT))
        return
    # (PermissionError: a root made unreadable; the next leader's start removes it)
    with suppress(FileNotFoundError, PermissionError), open_dir(marker.parent, "") as dir_fd:
        os.unlink(marker.name, dir_fd=dir_fd)  # a link itself, never its target
