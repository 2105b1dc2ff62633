"""The events the watcher queues for the index: their kinds and their shape.

Its own module so that the watcher and the nested-dir watches (cachemgr.daemon.nestwatch, which
the watcher imports) emit the same `Kind` members: consumers test kinds with `is`, and a plain
int 1 is not `Kind.WRITE` (a store found by a new dir's listing then went uncounted by GC).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Kind(IntEnum):
    WRITE = 1
    GONE = 2
    READ = 3
    NS_ADDED = 4
    NS_GONE = 5
    OVERFLOW = 6


# Whose access stream an event is of: this node's inotify, or (in a fleet's leader) the name of
# the node whose summary carried it. Each is one server's order of reads and stores, which the
# chain model learns prefixes from: two nodes' streams merged into one would teach it links
# between pages of unrelated requests (and break the links it learnt) wherever they interleave.
LOCAL = ""
# (kind, namespace id, file name (a path below the namespace dir), time.monotonic() when seen,
# origin)
Event = tuple[Kind, str, str, float, str]


@dataclass
class WatchGaps:
    """What inotify did not see. What a nested namespace's new dirs held when their watches
    were added (cachemgr.daemon.nestwatch): page files stored, and those of them whose atime
    showed a read (each store not matched by a read may still have been read unseen: a noatime
    root). And the dirs the kernel refused a watch (fs.inotify.max_user_watches reached): what
    happens in them is seen by the reconcile scans only."""

    stores: int = 0
    reads: int = 0
    refused: int = 0  # watches refused since the start (each retried at the next reconcile)
    refused_at: float | None = None  # wall clock of the latest refusal
    short: int = 0  # namespaces with a dir refused a watch and not watched since
    root: bool = False  # <root>/ns itself refused its watch and not watched since
