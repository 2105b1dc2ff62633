"""What the HTTP routes need from the daemon, in one object."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from cachemgr.daemon.api import PurgeFn, PurgeResponse
from cachemgr.daemon.fleet import FleetNode
from cachemgr.daemon.index_state import IndexState
from cachemgr.daemon.metrics import Reader
from cachemgr.gc.runner import GcRunner
from cachemgr.layout import Layout
from cachemgr.ns.quarantine import Quarantine
from cachemgr.settings import Settings
from cachemgr.worker import Worker


@dataclass
class Backend:
    """What the routes need from the daemon; tests build one over a temp root."""

    layout: Layout
    reader: Reader
    registry: CollectorRegistry
    token: str | None = None
    index: IndexState | None = None
    lag: Callable[[], float] = lambda: 0.0
    purge: PurgeFn | None = None
    after_purge: Callable[[PurgeResponse], None] = lambda r: None
    gc: GcRunner | None = None
    settings: Settings | None = None  # what one-off GC limits are checked against
    workers: Sequence[Worker] = ()  # their deaths fail /readyz
    quarantine: Quarantine | None = None  # what the daemon cannot use: /readyz says so
    fleet: FleetNode | None = None  # fleet mode's part of this daemon (cachemgr.daemon.fleet)
