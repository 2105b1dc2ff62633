"""The events the watcher queues for the index: their kinds and their shape.

Its own module so that the watcher and the nested-dir watches (cachemgr.daemon.nestwatch, which
the watcher imports) emit the same `Kind` members: consumers test kinds with `is`, and a plain
int 1 is not `Kind.WRITE` (a store found by a new dir's listing then went uncounted by GC).
"""

from __future__ import annotations

from enum import IntEnum


class Kind(IntEnum):
    WRITE = 1
    GONE = 2
    READ = 3
    NS_ADDED = 4
    NS_GONE = 5
    OVERFLOW = 6


# (kind, namespace id, file name (a path below the namespace dir), time.monotonic() when seen)
Event = tuple[Kind, str, str, float]
