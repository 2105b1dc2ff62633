"""Fleet mode in the daemon: the elector, the GC leadership on it, the shipping of this node's
accesses, the merging of the others' (its routes and metrics). See docs/fleet.md."""

from __future__ import annotations

import logging
import os
import socket
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from fastapi import Body, FastAPI
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from cachemgr.backends import FileFormat
from cachemgr.daemon.events import Event, Kind
from cachemgr.daemon.serving import is_loopback
from cachemgr.daemon.watcher import Watcher
from cachemgr.errors import ConflictError
from cachemgr.fleet.accesses import (
    MAX_BATCH,
    MAX_NAME,
    SILENT,
    SUMMARY_PATH,
    Access,
    AccessShipper,
    FleetAccesses,
    Summary,
)
from cachemgr.fleet.connect import open_coordinator
from cachemgr.fleet.coordinator import LeaderRecord
from cachemgr.fleet.elector import Elector, FleetLeadership
from cachemgr.layout import NS_ID_RE, Layout
from cachemgr.settings import Settings
from cachemgr.worker import DeathHandler

SUMMARY_MAX_BYTES = (MAX_NAME + 100) * MAX_BATCH  # a batch of the longest names, as JSON
NODE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$"
log = logging.getLogger(__name__)
_KINDS = {Kind.READ: "r", Kind.WRITE: "w", Kind.NS_GONE: "g", Kind.NS_ADDED: "a"}


def advertised_url(settings: Settings, port: int) -> str:
    """Where other nodes reach this daemon (fleet_advertise_url, else its bind address)."""
    if settings.fleet_advertise_url:
        return settings.fleet_advertise_url.rstrip("/")
    host = settings.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    elif is_loopback(host):
        # The default host: on another node this URL is that node's own daemon, which
        # answers "not the GC leader", so no follower's accesses would reach this one while
        # it leads. Right only for nodes on one host (tests), so said, not refused.
        log.warning(
            "fleet mode on a loopback address: other nodes cannot reach this daemon; set "
            "fleet_advertise_url (CACHEMGR_FLEET_ADVERTISE_URL) or host",
            extra={"advertised": f"http://{host}:{port}"},
        )
    return f"http://{host}:{port}"


@dataclass
class FleetNode:
    """This daemon's part in a fleet."""

    elector: Elector
    leadership: FleetLeadership
    shipper: AccessShipper
    accesses: FleetAccesses

    @property
    def workers(self) -> list[Elector | AccessShipper]:
        return [self.elector, self.shipper]

    def watch(self, watcher: Watcher) -> None:
        """Ship what `watcher` sees, and merge the others' accesses into its queue."""
        watcher.on_access = self._record
        self.accesses.apply = lambda node, batch: feed(watcher, node, batch)

    def ship_age(self) -> float:
        """Seconds since the leader last took this node's summary (0 while this node leads)."""
        return 0.0 if self.elector.leading() else time.monotonic() - self.shipper.last_taken

    def _record(self, event: Event) -> None:
        self.shipper.record(_KINDS[event[0]], event[1], event[2])  # type: ignore[arg-type]


def build_fleet(
    settings: Settings,
    layout: Layout,
    port: int,
    *,
    on_elected: Callable[[], None],
    on_death: DeathHandler,
) -> FleetNode:
    """The fleet's workers for this daemon (not started); `watch()` a watcher next."""
    assert layout.node is not None  # settings_layout names it in fleet mode
    coordinator = open_coordinator(settings)  # a setting that cannot work: its line alone
    record = LeaderRecord(layout.node, advertised_url(settings, port))
    elector = Elector(
        coordinator,
        record,
        settings.fleet_renew_interval,
        on_elected=lambda: elected(),
        unusable=lambda: root_problem(layout),
        on_death=on_death,
    )
    token = settings.token.get_secret_value() if settings.token else None
    # Reads go as often as the index applies a batch (at least once a second), stores within
    # STORE_GAP: the leader's GC counts another node's stores almost as soon as its own.
    shipper = AccessShipper(
        elector,
        capacity=settings.fleet_buffer,
        token=token,
        interval=min(1.0, settings.batch_interval),
        on_death=on_death,
    )

    def elected() -> None:
        shipper.clear()  # this node's own index has them: nobody else needs them now
        on_elected()

    return FleetNode(
        elector, FleetLeadership(layout.gc_lock, elector), shipper, FleetAccesses(lambda node, b: 0)
    )


def root_problem(layout: Layout) -> str | None:
    """Why this node's mount of the root cannot serve GC now (a stale NFS handle, a FUSE
    mount whose server died, the mount gone from under its path), or None."""
    try:
        st = os.stat(layout.ns_root)
    except OSError as e:
        return f"{layout.ns_root}: {e.strerror}"
    return None if stat.S_ISDIR(st.st_mode) else f"{layout.ns_root} is not a directory"


def feed(watcher: Watcher, node: str, batch: Sequence[Access]) -> int:
    """Queue `node`'s accesses as if this node's watcher had seen them, in that node's stream
    (their origin: cachemgr.daemon.events); how many were page names of a namespace dir here
    (a namespace made through another node's mount is watched now: this node's inotify never
    saw it made)."""
    formats: dict[str, FileFormat | None] = {}
    dirs: set[tuple[str, str]] = set()  # (kind, namespace) of the dir changes taken
    stores: set[tuple[str, str]] = set()  # (namespace, name) of the stores taken
    now, used = watcher.clock(), 0
    for kind, ns_id, name in batch:
        if kind in ("g", "a"):
            # Each kind once a namespace and batch: both are settled by what the dir is when
            # the index applies them, and each rescans the whole dir; a batch of them (a
            # follower's bug) would hold the index for hours on a big one.
            if (kind, ns_id) in dirs:
                continue
            dirs.add((kind, ns_id))
            used += _dir_changed(watcher, kind, ns_id, (now, node))
            formats.pop(ns_id, None)
            continue
        if ns_id not in formats:
            formats[ns_id] = _format(watcher, ns_id, (now, node))
        fmt = formats[ns_id]
        # Only a name this node's own watcher could queue: its format's dirs, nothing more
        # (no "/x", "./x", "a/../x" nor NUL: the index would count one file twice, or fail)
        where = None if fmt is None else fmt.split(name)
        if where is None or fmt is None or fmt.key_len(where[1]) is None:
            continue
        if not where[1].endswith(fmt.page_suffix):
            continue
        if kind == "w":
            # A store of a file that is there, once a batch: until the index applies it, GC
            # counts each store as a page of the largest size against the cap, so stores of
            # files never made or gone since (a broken follower's) would evict real pages.
            if (ns_id, name) in stores or not _is_file(watcher.layout.ns_dir(ns_id) / name):
                continue
            stores.add((ns_id, name))
        watcher.emit((Kind.READ if kind == "r" else Kind.WRITE, ns_id, name, now, node))
        used += 1
    return used


def _is_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _dir_changed(watcher: Watcher, kind: str, ns_id: str, seen: tuple[float, str]) -> int:
    """Another node saw a namespace dir leave ns/ ("g": a purge through its mount) or appear
    ("a": made, recreated empty, or a nested dir moved out of it): queue it as this node's
    watcher queues what it sees itself (its inotify sees only its own mount's changes)."""
    if not NS_ID_RE.fullmatch(ns_id):
        return 0
    if kind == "g":
        if not watcher.has(ns_id):
            return 0
        watcher.mark_gone(ns_id)
        if watcher.layout.ns_dir(ns_id).is_dir():
            # There still (recreated, or it never left: a broken follower's word): the gone
            # event ends this node's watch of it, so watch and rescan what is there, or this
            # node's own reads and stores in it would go unseen until a restart.
            watcher.emit((Kind.NS_ADDED, ns_id, "", *seen))
        return 1
    if not watcher.layout.ns_dir(ns_id).is_dir():
        return 0
    watcher.watch(ns_id)  # before the scan NS_ADDED asks for: this node's stores count
    watcher.emit((Kind.NS_ADDED, ns_id, "", *seen))
    return 1


def _format(watcher: Watcher, ns_id: str, seen: tuple[float, str]) -> FileFormat | None:
    if not NS_ID_RE.fullmatch(ns_id):
        return None
    if not watcher.has(ns_id):
        if not watcher.layout.ns_dir(ns_id).is_dir() or not watcher.watch(ns_id, fresh=True):
            return None
        watcher.emit((Kind.NS_ADDED, ns_id, "", *seen))
    return watcher.format_of(ns_id)


class SummaryIn(BaseModel):
    """A follower's accesses since its last summary, numbered from `first`, in order."""

    model_config = ConfigDict(extra="forbid")
    node: Annotated[str, Field(pattern=NODE_PATTERN)]
    session: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    first: Annotated[int, Field(ge=1)]
    dropped: Annotated[int, Field(ge=0)]
    accesses: Annotated[
        list[
            tuple[
                Literal["r", "w", "g", "a"],
                Annotated[str, Field(max_length=64)],
                Annotated[str, Field(max_length=MAX_NAME)],
            ]
        ],
        Field(max_length=MAX_BATCH),
    ]


class SummaryOut(BaseModel):
    accepted: int = Field(description="accesses that named a page of a namespace here")


class NodeOut(BaseModel):
    node: str
    last_summary_age_seconds: float
    accesses: int
    dropped: int


class FleetOut(BaseModel):
    enabled: bool
    node: str | None = None
    leading: bool = False
    leader: str | None = Field(None, description="the lease holder's node name")
    leader_url: str | None = None
    coordinator_up: bool = False
    nodes: list[NodeOut] = Field(default_factory=list, description="leader: who shipped")
    buffered: int = 0
    shipped: int = 0
    dropped: int = 0
    ship_age_seconds: float = Field(
        0.0, description="follower: seconds since the leader last took its summary; 0 leading"
    )


def add_fleet_routes(app: FastAPI, fleet: FleetNode | None) -> None:
    """POST /v1/fleet/accesses (followers to the leader) and GET /v1/fleet."""

    @app.post(
        SUMMARY_PATH,
        response_model=SummaryOut,
        tags=["fleet"],
        responses={
            404: {"description": "fleet mode is off"},
            409: {"description": "not leading; the leader's own node name; too many nodes"},
        },
    )
    def post_accesses(summary: Annotated[SummaryIn, Body()]) -> SummaryOut:
        """Another node's page reads and stores, for the GC leader's eviction order."""
        if fleet is None:
            raise HTTPException(404, "fleet mode is off on this node")
        if not fleet.elector.leading():
            leader = fleet.elector.leader
            raise HTTPException(409, f"not the GC leader; leader: {leader.url if leader else None}")
        if summary.node == fleet.elector.record.node:  # it would show as a silent node
            raise ConflictError(
                f"{summary.node} is this leader's own node name; give each node its own"
            )
        accesses: list[Access] = [(k, ns, name) for k, ns, name in summary.accesses]
        got = Summary(summary.node, summary.session, summary.first, summary.dropped, accesses)
        return SummaryOut(accepted=fleet.accesses.merge(got))

    @app.get("/v1/fleet", response_model=FleetOut, tags=["fleet"])
    def get_fleet() -> FleetOut:
        """This node's view of the fleet: the leader, and (on the leader) who ships to it."""
        if fleet is None:
            return FleetOut(enabled=False)
        el, ship = fleet.elector, fleet.shipper
        seen = fleet.accesses.nodes
        ages = fleet.accesses.ages()
        nodes = [
            NodeOut(
                node=n,
                last_summary_age_seconds=round(ages[n], 3),
                accesses=seen[n].accesses,
                dropped=seen[n].dropped,
            )
            for n in sorted(ages)
        ]
        return FleetOut(
            enabled=True,
            node=el.record.node,
            leading=el.leading(),
            leader=el.leader.node if el.leader else None,
            leader_url=el.leader.url if el.leader else None,
            coordinator_up=el.coordinator_up,
            nodes=nodes if el.leading() else [],
            buffered=ship.pending(),
            shipped=ship.shipped,
            dropped=ship.dropped,
            ship_age_seconds=round(fleet.ship_age(), 3),
        )


FLEET_METRICS = {
    "cachemgr_fleet_leader": "1 while this node holds the fleet's GC lease",
    "cachemgr_fleet_coordinator_up": "1 while the fleet's coordinator answered the last round",
    "cachemgr_fleet_nodes": "leader: nodes heard from in the last minute, itself included",
    "cachemgr_fleet_summary_age_seconds": "leader: seconds since each node's last summary",
    "cachemgr_fleet_accesses_received_total": "leader: accesses merged from each node",
    "cachemgr_fleet_accesses_shipped_total": "follower: accesses the leader took",
    "cachemgr_fleet_accesses_dropped_total": "follower: accesses dropped from a full buffer",
    "cachemgr_fleet_accesses_buffered": "follower: accesses waiting for the leader",
    "cachemgr_fleet_ship_age_seconds": "follower: seconds since the leader last took this "
    "node's summary (an idle node sends an empty one every 5 s); 0 while leading",
}


class FleetCollector:
    """The fleet's metrics, from counters in memory (no I/O at scrape time)."""

    def __init__(self, fleet: FleetNode) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        el, ship, acc = self.fleet.elector, self.fleet.shipper, self.fleet.accesses
        leading = el.leading()
        m = FLEET_METRICS
        yield GaugeMetricFamily("cachemgr_fleet_leader", m["cachemgr_fleet_leader"], int(leading))
        up = GaugeMetricFamily(
            "cachemgr_fleet_coordinator_up", m["cachemgr_fleet_coordinator_up"], el.coordinator_up
        )
        yield up
        ages = acc.ages() if leading else {}
        live = 1 + sum(1 for n, a in ages.items() if a < SILENT and n != el.record.node)
        yield GaugeMetricFamily("cachemgr_fleet_nodes", m["cachemgr_fleet_nodes"], live * leading)
        age = GaugeMetricFamily(
            "cachemgr_fleet_summary_age_seconds",
            m["cachemgr_fleet_summary_age_seconds"],
            labels=["node"],
        )
        got = CounterMetricFamily(
            "cachemgr_fleet_accesses_received",
            m["cachemgr_fleet_accesses_received_total"],
            labels=["node"],
        )
        for node, seconds in sorted(ages.items()):
            age.add_metric([node], seconds)
            got.add_metric([node], acc.nodes[node].accesses)
        yield age
        yield got
        yield CounterMetricFamily(
            "cachemgr_fleet_accesses_shipped",
            m["cachemgr_fleet_accesses_shipped_total"],
            ship.shipped,
        )
        yield CounterMetricFamily(
            "cachemgr_fleet_accesses_dropped",
            m["cachemgr_fleet_accesses_dropped_total"],
            ship.dropped,
        )
        yield GaugeMetricFamily(
            "cachemgr_fleet_accesses_buffered",
            m["cachemgr_fleet_accesses_buffered"],
            ship.pending(),
        )
        yield GaugeMetricFamily(
            "cachemgr_fleet_ship_age_seconds",
            m["cachemgr_fleet_ship_age_seconds"],
            self.fleet.ship_age(),
        )
