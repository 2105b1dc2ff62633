"""HTTP connections bounded in number and in time, so a flood of them cannot take the file
descriptors the index writer, the watcher, SQLite and GC need, nor shut out a fresh client.

- The soft RLIMIT_NOFILE is raised to the hard limit at start.
- Open connections are capped at the limit less what is open at start, `http_fd_reserve`, and
  what asyncio's accept loop can take before a connection is counted (ConnectionGuard).
- A request (head and body) must arrive within `http_header_timeout` of the connection, or of
  its first byte after a keep-alive response, or of the response before it when it came
  pipelined behind that one (GuardedH11Protocol). uvicorn's h11 protocol has
  no such timer: a connection that sends nothing, or half a head, is held for ever (its
  keep-alive timer starts only after a response and is cancelled by the next byte).
- At the cap, a new connection makes room by closing the oldest one waiting for its client (a
  request not all in, idle between requests, or a response it does not read), as nginx drains
  its reusable connections; if every one is running a request, the new one is closed.
  Accepting always, rather than pausing accept, keeps the listen queue drained: a fresh client
  is not stuck behind a flood's SYNs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import h11
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from uvicorn.protocols.http.h11_impl import H11Protocol

from cachemgr.daemon.metrics import METRICS

log = logging.getLogger(__name__)

CloseReason = Literal["header_timeout", "evicted", "refused"]
CLOSE_REASONS: tuple[CloseReason, ...] = ("header_timeout", "evicted", "refused")
# asyncio accepts up to the listen backlog per wake-up and creates each protocol a few loop
# turns later, so up to a few backlogs' worth of fds are open before the guard sees them.
ACCEPT_BATCHES = 4
MIN_CAP = 8  # fewer connections than this and the API is not usable (a scrape, a CLI, a probe)
WARN_EVERY = 60.0  # seconds between log lines about closing connections at the cap


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (systemd's default soft limit is 1024);
    (soft, hard) as they are now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError) as e:  # hard is RLIM_INFINITY past the kernel's nr_open
            log.warning("cannot raise the open-file limit", extra={"soft": soft, "error": str(e)})
        else:
            log.info("raised the open-file limit", extra={"from": soft, "to": hard})
            soft = hard
    return soft, hard


def open_fds() -> int:
    """File descriptors this process holds now (the listing's own one not counted)."""
    return len(os.listdir("/proc/self/fd")) - 1


@dataclass(frozen=True)
class ConnectionBudget:
    """How many connections fit: the soft limit less what is open, the reserve and accept's
    batches; `wanted` (http_max_connections) if that is fewer."""

    soft_limit: int
    open_now: int
    reserve: int
    backlog: int
    wanted: int

    @property
    def cap(self) -> int:
        room = self.soft_limit - self.open_now - self.reserve - ACCEPT_BATCHES * self.backlog
        return max(MIN_CAP, min(self.wanted, room))


class Tracked(Protocol):
    """What the guard needs of a connection."""

    def waiting(self) -> bool: ...

    def close(self) -> None: ...


class ConnectionGuard:
    """The open connections, oldest first; at the cap a new one takes an idle one's place."""

    def __init__(self, cap: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.cap = cap
        self.closed: Counter[CloseReason] = Counter()
        self._open: dict[Tracked, None] = {}
        self._clock = clock
        self._warned = float("-inf")

    @classmethod
    def within(cls, budget: ConnectionBudget) -> ConnectionGuard:
        """A guard at the budget's cap, logged (with a warning if the open-file limit lowered
        it below http_max_connections)."""
        guard = cls(budget.cap)
        log.info(
            "HTTP connection limits",
            extra={
                "max_connections": guard.cap,
                "nofile": budget.soft_limit,
                "fds_open": budget.open_now,
                "fd_reserve": budget.reserve,
            },
        )
        if guard.cap < budget.wanted:
            log.warning(
                "the open-file limit lowers the HTTP connection cap",
                extra={"max_connections": guard.cap, "wanted": budget.wanted},
            )
        return guard

    @property
    def open(self) -> int:
        return len(self._open)

    def admit(self, conn: Tracked) -> bool:
        """Count a new connection in; False if it must be closed (every other one is busy)."""
        if len(self._open) >= self.cap:
            victim = next((c for c in self._open if c.waiting()), None)
            if victim is None:
                self.count_closed("refused")
                return False
            self.release(victim)
            victim.close()
            self.count_closed("evicted")
        self._open[conn] = None
        return True

    def release(self, conn: Tracked) -> None:
        self._open.pop(conn, None)

    def count_closed(self, reason: CloseReason) -> None:
        self.closed[reason] += 1
        if reason != "header_timeout" and self._clock() - self._warned >= WARN_EVERY:
            self._warned = self._clock()
            log.warning(
                "HTTP connection cap reached: closing idle connections",
                extra={"cap": self.cap, "closed": dict(self.closed)},
            )


class ConnectionMetrics:
    """A Prometheus collector of the guard's counts (live: a scrape reads three numbers)."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard

    def collect(self) -> Iterator[Any]:
        for name, value in (
            ("cachemgr_http_connections", self.guard.open),
            ("cachemgr_http_connections_max", self.guard.cap),
        ):
            yield GaugeMetricFamily(name, METRICS[name], value=value)
        name = "cachemgr_http_connections_closed_total"
        closed = CounterMetricFamily(name, METRICS[name], labels=["reason"])
        for reason in CLOSE_REASONS:
            closed.add_metric([reason], self.guard.closed[reason])
        yield closed


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, counted by a ConnectionGuard and with a request-read deadline."""

    guard: ClassVar[ConnectionGuard]
    header_timeout: ClassVar[float]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None

    @classmethod
    def bound(cls, guard: ConnectionGuard, header_timeout: float) -> type[GuardedH11Protocol]:
        """The class uvicorn instantiates per connection (it passes no extra arguments)."""
        attrs = {"guard": guard, "header_timeout": header_timeout}
        return type(cls.__name__, (cls,), attrs)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.guard.admit(self):
            self._arm()
        else:
            transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.release(self)
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # a new request on a kept-alive connection: its own deadline
        super().data_received(data)
        if not self.waiting():
            self._disarm()  # all of it is in: the app may take as long as it needs

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A pipelined request's bytes came with the one just answered: no data_received will
        # start its deadline, and half of one would live for the keep-alive timeout.
        if self._deadline is None and not self.transport.is_closing() and self._part_in():
            self._arm()

    def _part_in(self) -> bool:
        """Some of the next request is in, not all of it."""
        their = self.conn.their_state
        return their is h11.SEND_BODY or (their is h11.IDLE and bool(self.conn.trailing_data[0]))

    def waiting(self) -> bool:
        """True while the connection waits for its client: a request not all in, idle, or a
        response the client does not read (its writes paused: pipelined requests behind it
        would otherwise keep it busy, and unevictable, for as long as the client likes)."""
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY) or self.flow.write_paused

    def close(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()

    def _arm(self) -> None:
        self._deadline = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.waiting():
            self.guard.release(self)
            self.guard.count_closed("header_timeout")
            self.close()
