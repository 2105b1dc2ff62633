"""What the fleet asks of a coordinator (etcd, a Kubernetes Lease): one lease per shared root,
held by one node at a time, with a record saying which node and where it serves HTTP.

A `Term` is one holding of the lease. Its `token` changes whenever the lease changes hands
(etcd: the lease id and the key's create revision; Kubernetes: the Lease's resourceVersion),
so `holds(term)`, asked of the coordinator itself, tells a leader that was paused or cut off
that it is not the leader any more, whatever its own clock says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from cachemgr.errors import ConfigError


class CoordinatorDown(Exception):
    """The coordinator did not answer (connection refused, timeout, a 5xx)."""


@dataclass(frozen=True)
class LeaderRecord:
    """Who holds the lease: the node's name and the base URL of its daemon."""

    node: str
    url: str

    def encode(self) -> str:
        return json.dumps({"node": self.node, "url": self.url}, sort_keys=True)

    @classmethod
    def decode(cls, raw: str | bytes) -> LeaderRecord | None:
        """The record in a lease value; None if it is not one of ours."""
        try:
            data = json.loads(raw)
            return cls(str(data["node"]), str(data["url"]))
        except (ValueError, TypeError, KeyError):
            return None


@dataclass(frozen=True)
class Term:
    """One holding of the lease by this node."""

    record: LeaderRecord
    token: str  # what the coordinator changes when the lease changes hands


class Coordinator(Protocol):
    """One lease per shared root (every call may raise CoordinatorDown)."""

    ttl: float  # seconds the lease outlives its last renewal

    def campaign(self, record: LeaderRecord) -> Term | None:
        """Take the lease if nobody holds it; None if another node does."""
        ...

    def renew(self, term: Term) -> Term | None:
        """Keep holding it; None if it was lost (expired, taken)."""
        ...

    def holds(self, term: Term) -> bool:
        """Whether `term` still holds the lease, asked of the coordinator (the fence)."""
        ...

    def leader(self) -> LeaderRecord | None:
        """Who holds the lease now (None: nobody)."""
        ...

    def resign(self, term: Term) -> None:
        """Give the lease up at once (a clean stop), so another node need not wait it out."""
        ...

    def close(self) -> None: ...


def parse_endpoints(value: str) -> list[tuple[str, int]]:
    """`etcd://HOST:PORT[,HOST:PORT...]` as (host, port) pairs; ConfigError naming the bad part."""
    rest = value.removeprefix("etcd://")
    endpoints = []
    for part in rest.split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"invalid fleet_coordinator endpoint {part!r}: want HOST:PORT, "
                "e.g. etcd://10.0.0.5:2379,10.0.0.6:2379"
            )
        endpoints.append((host.strip("[]"), int(port)))
    return endpoints
