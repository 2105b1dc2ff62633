"""The GC leader election of a fleet: a worker that campaigns for the coordinator's lease and
renews it, and the GC leadership built on it.

Leading is local and cheap (`leading()`): this node won or renewed the lease less than a TTL
ago, by its monotonic clock, counted from before the request went out (the coordinator's TTL
starts later, so a leader gives up before the coordinator lets another take over). The fence
(`fence()`) asks the coordinator itself whether the term still holds: GC asks it before each
chunk it deletes, so a leader paused past its lease (SIGSTOP, a VM freeze, a long GC pause)
finds out on waking, before it deletes anything, even if its clock jumped with it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cachemgr.fleet.coordinator import Coordinator, CoordinatorDown, LeaderRecord, Term
from cachemgr.fs.leadership import Leadership
from cachemgr.worker import DeathHandler, Worker

log = logging.getLogger(__name__)
MARGIN = 0.2  # of the TTL: a leader stops leading that much before the coordinator would


class Elector(Worker):
    """Campaigns for the lease every `renew_interval` while another node holds it, renews it
    while this one does; `leader` is the last holder seen (where followers ship accesses)."""

    def __init__(
        self,
        coordinator: Coordinator,
        record: LeaderRecord,
        renew_interval: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_elected: Callable[[], None] = lambda: None,
        unusable: Callable[[], str | None] = lambda: None,
        on_death: DeathHandler | None = None,
    ) -> None:
        super().__init__("fleet", on_death=on_death)
        self.on_elected = on_elected  # a new leader runs GC at once (its order, rebuilt)
        # Why this node could not run GC now (its mount of the root gone stale), asked each
        # round: such a node neither keeps nor takes the lease. One that kept it failed every
        # GC cycle while renewing, and no node deleted at all.
        self.unusable = unusable
        self.standing_down: str | None = None
        self.coordinator, self.record = coordinator, record
        self.renew_interval, self.clock = renew_interval, clock
        self.term: Term | None = None
        self.valid_until = float("-inf")
        self.leader: LeaderRecord | None = None
        self.coordinator_up = False
        self.terms = 0  # terms this node won
        self._round_lock = threading.Lock()
        self._down_said = False
        self._twin_said = False

    def leading(self) -> bool:
        """Whether this node holds the lease by its own clock (no request)."""
        return self.term is not None and self.clock() < self.valid_until

    def fence(self) -> bool:
        """Whether this node may delete now: it leads, and the coordinator says its term holds."""
        term = self.term
        if term is None or not self.leading():
            return False
        try:
            held = self.coordinator.holds(term)
        except CoordinatorDown:
            return False  # unknown is no: deleting needs a lease someone can vouch for
        return held and self.leading()

    def round(self) -> None:
        """One renewal or campaign (the loop's step; tests call it directly)."""
        with self._round_lock:
            why = self.unusable()
            self._say_standing_down(why)
            sent = self.clock()
            try:
                if why is None:
                    self._renew_or_campaign(sent)
                elif self.term is not None:
                    term, self.term = self.term, None
                    self._lost(why)
                    self.coordinator.resign(term)  # the next node need not wait out the TTL
                self.leader = self.term.record if self.term else self.coordinator.leader()
            except CoordinatorDown as e:
                self._down(e)
                return
            if self._down_said:
                log.info("fleet coordinator answers again", extra={"node": self.record.node})
                self._down_said = False
            self.coordinator_up = True
            self._check_name()

    def _say_standing_down(self, why: str | None) -> None:
        if why is not None and self.standing_down is None:
            log.warning(
                "this node cannot run GC on the root; not campaigning for the GC lease",
                extra={"node": self.record.node, "why": why},
            )
        elif why is None and self.standing_down is not None:
            log.info("the root is usable again; campaigning", extra={"node": self.record.node})
        self.standing_down = why

    def _check_name(self) -> None:
        """Another daemon holding the lease under this node's name: this one would never ship
        its accesses (it takes that leader for itself) and their instances' binding files
        would be one; said once, as an error."""
        leader = self.leader
        twin = self.term is None and leader is not None and leader.node == self.record.node
        if twin and not self._twin_said:
            log.error(
                "another daemon leads the fleet under this node's name; give each node its "
                "own node_name (CACHEMGR_NODE_NAME)",
                extra={"node": self.record.node, "leader_url": leader.url if leader else None},
            )
        self._twin_said = twin

    def _renew_or_campaign(self, sent: float) -> None:
        ttl = self.coordinator.ttl
        if self.term is not None:
            if self.clock() >= self.valid_until:
                self._lost("expired before it was renewed")
            elif (renewed := self.coordinator.renew(self.term)) is None:
                self._lost("taken or expired at the coordinator")
            else:  # (a Lease's token is the version this renewal wrote)
                self.term, self.valid_until = renewed, sent + ttl * (1 - MARGIN)
                return
        term = self.coordinator.campaign(self.record)
        if term is not None:
            self.term, self.valid_until = term, sent + ttl * (1 - MARGIN)
            self.terms += 1
            log.info("leading the fleet's GC", extra={"node": self.record.node})
            self.on_elected()

    def _lost(self, why: str) -> None:
        self.term, self.valid_until = None, float("-inf")
        # Unknown until the coordinator answers (a round that reached it names the holder at
        # once); it was this node, which no longer leads, so saying so would be false.
        self.leader = None
        log.warning("lost the fleet's GC lease", extra={"node": self.record.node, "why": why})

    def _down(self, error: CoordinatorDown) -> None:
        """The coordinator did not answer: leading lapses by the clock; said once."""
        self.coordinator_up = False
        if self.term is not None and not self.leading():
            self._lost("the coordinator did not answer within the lease")
        if not self._down_said:
            log.warning(
                "fleet coordinator unreachable; no node deletes without a lease",
                extra={"node": self.record.node, "error": str(error)},
            )
            self._down_said = True

    def _loop(self) -> None:
        try:
            while True:
                self.round()
                if self._stopping.wait(self.renew_interval):
                    break
        finally:
            self._resign()

    def _resign(self) -> None:
        """A clean stop hands the lease over at once instead of after its TTL."""
        term, self.term = self.term, None
        if term is not None:
            with contextlib.suppress(CoordinatorDown):  # then it expires on its own
                self.coordinator.resign(term)
        self.coordinator.close()


class FleetLeadership(Leadership):
    """GC leadership in fleet mode: the node's GC lock (one daemon per state dir) and the
    fleet's lease. Without the lease this node's GC does not run, and the lock is let go."""

    def __init__(self, path: Path, elector: Elector) -> None:
        super().__init__(path)
        self.elector = elector

    @property
    def held(self) -> bool:
        return super().held and self.elector.leading()

    def try_acquire(self) -> bool:
        if not self.elector.leading():
            self.release()
            return False
        return super().try_acquire()

    def fence(self) -> bool:
        return super().held and self.elector.fence()

    def run_fence(self) -> Callable[[], bool]:
        # A lease lost and won again in one elector round (revoked by an operator, expired in
        # a pause) is a new term: the run's plan was made under the old one, and another node
        # may have led in between, so the run ends as if the lease were gone.
        won = self.elector.terms
        return lambda: self.elector.terms == won and self.fence()

    def led_elsewhere(self) -> bool:
        leader = self.elector.leader
        return leader is not None and leader.node != self.elector.record.node

    def holder(self) -> str | None:
        leader = self.elector.leader
        if leader is not None:
            return f"node {leader.node} at {leader.url}"
        # Said outright: a refused POST /v1/gc during an outage read "(None)", as if another
        # node deleted meanwhile.
        why = "is electing one" if self.elector.coordinator_up else "does not answer"
        return f"none: no node holds the fleet's GC lease now, and its coordinator {why}"
