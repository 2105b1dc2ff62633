"""The lease in etcd v3, through its JSON gateway (/v3/...) with OpenStack's etcd3gw client.

etcd3gw talks plain HTTP with requests: no grpcio or protobuf in the daemon's environment
(python-etcd3 pins an old protobuf and is unmaintained). The leader key is created in one
transaction only if absent (create_revision 0), attached to a lease of `ttl` seconds that
the holder keeps alive; etcd deletes the key when the lease expires. The term's token is the
lease id and the key's create revision: a key made again by another node, or by this node
after it lost the lease, never matches an old term.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import Etcd3Exception
from etcd3gw.lease import Lease
from etcd3gw.utils import _encode

from cachemgr.fleet.coordinator import CoordinatorDown, LeaderRecord, Term

log = logging.getLogger(__name__)
TIMEOUT = 2.0  # seconds per request: well inside a renewal interval


class EtcdCoordinator:
    """One leader key under /cachemgr/<lease name>/ on an etcd cluster (any endpoint)."""

    def __init__(self, endpoints: list[tuple[str, int]], lease_name: str, ttl: float) -> None:
        self.ttl = ttl
        self.key = f"/cachemgr/{lease_name}/leader"
        self._clients = [
            Etcd3Client(host, port, timeout=TIMEOUT, api_path="/v3/") for host, port in endpoints
        ]
        self._endpoints = [f"{host}:{port}" for host, port in endpoints]
        self._current = 0

    def _call(self, op: Callable[[Etcd3Client], Any]) -> Any:
        """`op` on the endpoint that answered last, else on the next ones in turn."""
        error: Exception | None = None
        why = ""
        for i in range(len(self._clients)):
            at = (self._current + i) % len(self._clients)
            try:
                result = op(self._clients[at])
            except (Etcd3Exception, requests.RequestException) as e:
                error, why = e, f"{self._endpoints[at]}: {_reason(e)}"
                continue
            self._current = at
            return result
        raise CoordinatorDown(f"etcd {why}") from error

    def campaign(self, record: LeaderRecord) -> Term | None:
        def attempt(client: Etcd3Client) -> Term | None:
            lease = client.lease(max(1, math.ceil(self.ttl)))
            key = _encode(self.key)
            put = {"key": key, "value": _encode(record.encode()), "lease": lease.id}
            txn = {
                "compare": [
                    {"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}
                ],
                "success": [{"request_put": put}],
                "failure": [],
            }
            result = client.transaction(txn)
            if not result.get("succeeded"):
                lease.revoke()  # someone leads: this lease would only linger until its TTL
                return None
            return Term(record, f"{lease.id}@{result['header']['revision']}")

        term: Term | None = self._call(attempt)
        return term

    def renew(self, term: Term) -> Term | None:
        lease_id = int(term.token.split("@")[0])
        ttl = self._call(lambda c: Lease(lease_id, c).refresh())
        if ttl <= 0 or not self.holds(term):
            return None
        return term

    def holds(self, term: Term) -> bool:
        kv = self._leader_kv()
        if kv is None:
            return False
        _, meta = kv
        token = f"{int(meta.get('lease', 0))}@{int(meta.get('create_revision', 0))}"
        return token == term.token

    def leader(self) -> LeaderRecord | None:
        kv = self._leader_kv()
        return None if kv is None else LeaderRecord.decode(kv[0])

    def _leader_kv(self) -> tuple[bytes, dict[str, Any]] | None:
        found = self._call(lambda c: c.get(self.key, metadata=True))
        if not found:
            return None
        value, meta = found[0]
        return value, dict(meta)

    def resign(self, term: Term) -> None:
        lease_id = int(term.token.split("@")[0])
        if self.holds(term):
            self._call(lambda c: Lease(lease_id, c).revoke())

    def close(self) -> None:
        for client in self._clients:
            client.session.close()


def _reason(error: Exception) -> str:
    """What went wrong, in words: etcd3gw keeps its message in `detail_text`, not in the
    exception's args (str() of a refused connection is empty)."""
    detail = getattr(error, "detail_text", None) or str(error)
    return f"{type(error).__name__}: {detail}" if detail else type(error).__name__
