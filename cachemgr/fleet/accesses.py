"""Every node's page accesses reach the leader: followers ship what their inotify saw (reads
and stores in order, per namespace and page) once a second over the daemon's authenticated
HTTP; the leader feeds them to its own index and chain model as if its own watcher had seen
them, so a page read only on another node is as alive as one read on the leader's.

Stores are shipped within STORE_GAP (the leader's GC must count them against the cap as soon
as its own); reads at least once an `interval`. A follower keeps at most `capacity` accesses
for the leader: when it cannot reach one (an
election, a partition) the oldest go first, and are counted. Each access has the node's
sequence number, so a batch sent again (its answer lost) is not counted twice, and what is
shipped leaves the buffer only once the leader took it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import httpx

from cachemgr.errors import ConflictError
from cachemgr.fleet.elector import Elector
from cachemgr.worker import DeathHandler, Worker

log = logging.getLogger(__name__)
# a read, a store; the namespace's dir left ns/ ("g": a purge through this node's mount) or
# came ("a": made, recreated, or a nested dir moved out of it), the page name empty: the
# leader's inotify sees none of these made through another node's mount
AccessKind = Literal["r", "w", "g", "a"]
Access = tuple[AccessKind, str, str]  # (kind, namespace id, page name below its dir)
MAX_BATCH = 5_000  # accesses per request: a second of a busy node, under the body cap
MAX_NAME = 300  # characters of a page name below its namespace dir (vLLM's paths: ~100)
SHIP_INTERVAL = 1.0
STORE_GAP = 0.05  # seconds at least between two requests: a burst of stores is one batch
# seconds at most between two summaries: an idle node sends an empty one, so the leader (and
# the alert on its summary ages) tells a node with nothing to say from one it cannot hear
HEARTBEAT = 5.0
SUMMARY_PATH = "/v1/fleet/accesses"
# Answers that say the leader will never take this node's summaries as sent (a wrong token,
# fleet mode off there): said at once, not after an election's worth of failures.
REFUSED = (401, 403, 404)
# seconds without a summary after which a node no longer counts in the fleet (the leader's
# node count) and doctor says the leader does not hear it
SILENT = 60.0
# Nodes the leader keeps an entry for (sequence numbers, metrics labels, their streams in its
# chain model): far more than a fleet has, few enough that a follower posting ever new names
# (a bug, a leaked token) cannot grow the leader without bound. One silent for FORGET seconds
# makes room for a new one.
MAX_NODES = 1024
FORGET = 3600.0


class AccessShipper(Worker):
    """A follower's side: buffers this node's accesses and ships them to the leader."""

    def __init__(
        self,
        elector: Elector,
        *,
        capacity: int,
        token: str | None,
        interval: float = SHIP_INTERVAL,
        on_death: DeathHandler | None = None,
    ) -> None:
        super().__init__("fleet-ship", on_death=on_death)
        self.elector, self.interval = elector, interval
        self._buffer: deque[tuple[int, Access]] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._seq = 0
        self._stored = threading.Event()
        self.session = uuid.uuid4().hex  # a restarted node's numbers start again at 1
        self.dropped = 0  # accesses pushed out of a full buffer
        self.shipped = 0  # accesses the leader took
        self.failures = 0  # requests the leader did not take
        self.last_taken = time.monotonic()  # when the leader last took a summary (or start)
        self._warned = False  # the failures since the leader last took a summary were said
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(timeout=5.0, headers=headers)

    def record(self, kind: AccessKind, ns_id: str, name: str) -> None:
        """One access this node's watcher saw (on the inotify thread: O(1), no I/O)."""
        if self.elector.leading() or len(name) > MAX_NAME:
            return  # the leader's own watcher feeds its model already
        with self._lock:
            if len(self._buffer) == self._buffer.maxlen:
                self.dropped += 1
            self._seq += 1
            self._buffer.append((self._seq, (kind, ns_id, name)))
        if kind != "r":
            # the leader's GC counts stores against its cap, and a purged namespace's pages
            # as used until it hears of it: ship soon
            self._stored.set()

    def clear(self) -> None:
        """Forget what is buffered (this node leads now: its own index saw all of it)."""
        with self._lock:
            self._buffer.clear()
        self.last_taken = time.monotonic()

    def pending(self) -> int:
        return len(self._buffer)

    def ship(self) -> int:
        """Send what is buffered (at most MAX_BATCH) to the leader, or an empty summary once a
        HEARTBEAT; how many accesses it took."""
        if self.elector.leading():
            # Its own index takes them: nothing waits for a leader. An ex-leader's first
            # failure after a handover is then not "a minute without a leader taking them".
            self.last_taken = time.monotonic()
            return 0
        leader = self.elector.leader
        if leader is None or leader.node == self.elector.record.node:
            return 0
        with self._lock:
            batch = [self._buffer[i] for i in range(min(len(self._buffer), MAX_BATCH))]
            dropped, first = self.dropped, self._seq + 1
        if not batch and time.monotonic() - self.last_taken < HEARTBEAT:
            return 0
        body = {
            "node": self.elector.record.node,
            "session": self.session,
            "first": batch[0][0] if batch else first,
            "dropped": dropped,
            "accesses": [list(a) for _, a in batch],
        }
        try:
            r = self._http.post(leader.url + SUMMARY_PATH, json=body)
        except httpx.HTTPError as e:
            return self._failed(leader.url, str(e))
        if r.status_code in (413, 422):  # never taken, however often sent: counted as dropped
            return self._refused(batch, r.status_code)
        if r.status_code != 200:
            return self._failed(leader.url, f"HTTP {r.status_code}", r.status_code in REFUSED)
        self.last_taken = time.monotonic()
        if self._warned:
            log.info("the GC leader takes this node's accesses again", extra={"leader": leader.url})
            self._warned = False
        last = batch[-1][0] if batch else 0
        with self._lock:  # drops meanwhile took from the left: pop only what was sent
            while self._buffer and self._buffer[0][0] <= last:
                self._buffer.popleft()
        self.shipped += len(batch)
        return len(batch)

    def _refused(self, batch: list[tuple[int, Access]], status: int) -> int:
        last = batch[-1][0]
        with self._lock:
            while self._buffer and self._buffer[0][0] <= last:
                self._buffer.popleft()
                self.dropped += 1
        log.warning("the leader refused a batch of accesses", extra={"status": status})
        return 0

    def _failed(self, url: str, why: str, refused: bool = False) -> int:
        """A summary not taken: said once a streak, at once if the leader refuses this node
        (a wrong token never heals), else once the streak outlasts an election (SILENT)."""
        self.failures += 1
        if self._warned or not (refused or time.monotonic() - self.last_taken > SILENT):
            log.debug("accesses not shipped", extra={"leader": url, "error": why})
            return 0
        log.warning(
            "the GC leader takes none of this node's accesses: its eviction order misses "
            "them; buffering them",
            extra={"leader": url, "error": why},
        )
        self._warned = True
        return 0

    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._stored.wait(self.interval)
                self._stored.clear()
                while self.ship() >= MAX_BATCH:  # behind: catch up before the next round
                    pass
                self._stopping.wait(STORE_GAP)
        finally:
            self._http.close()

    def _interrupt(self) -> None:
        self._stored.set()


@dataclass(frozen=True)
class Summary:
    """One follower's batch: its accesses numbered from `first`, in the order seen."""

    node: str
    session: str
    first: int
    dropped: int
    accesses: Sequence[Access]


@dataclass
class NodeSeen:
    """What the leader heard from one node."""

    session: str = ""
    last_seq: int = 0
    last_at: float = 0.0  # time.monotonic() of its last summary
    accesses: int = 0
    dropped: int = 0  # the node's own count of accesses its buffer dropped


@dataclass
class FleetAccesses:
    """The leader's side: merges followers' summaries into its model through `apply`."""

    apply: Callable[
        [str, Sequence[Access]], int
    ]  # feeds a node's accesses to the index: how many used
    clock: Callable[[], float] = time.monotonic
    nodes: dict[str, NodeSeen] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def merge(self, summary: Summary) -> int:
        """Take one summary; the accesses it repeats (a batch sent again) are skipped.
        ConflictError for a node past MAX_NODES."""
        node, first, accesses = summary.node, summary.first, summary.accesses
        with self._lock:
            seen = self.nodes.get(node) or self._admit(node)
            if seen.session != summary.session:
                seen.session, seen.last_seq = summary.session, 0
            if first + len(accesses) - 1 < seen.last_seq or first <= 0:
                fresh: Sequence[Access] = ()
            else:
                fresh = accesses[max(0, seen.last_seq - first + 1) :]
            seen.last_seq = max(seen.last_seq, first + len(accesses) - 1)
            seen.last_at, seen.dropped = self.clock(), summary.dropped
            seen.accesses += len(fresh)
        return self.apply(node, fresh) if fresh else 0

    def _admit(self, node: str) -> NodeSeen:
        if len(self.nodes) >= MAX_NODES:
            now = self.clock()
            for name in [n for n, seen in self.nodes.items() if now - seen.last_at > FORGET]:
                del self.nodes[name]
        if len(self.nodes) >= MAX_NODES:
            raise ConflictError(
                f"the leader hears from {MAX_NODES} nodes already; {node} is not one of them"
            )
        seen = self.nodes[node] = NodeSeen()
        return seen

    def ages(self) -> dict[str, float]:
        """Seconds since each node's last summary."""
        now = self.clock()
        with self._lock:
            return {node: now - seen.last_at for node, seen in self.nodes.items()}
