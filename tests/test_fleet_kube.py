"""The Kubernetes Lease coordinator through the official client, against a recorded API
server: no API server runs here, so a small HTTP server answers as kube-apiserver answers
for one Lease (the shapes below are recorded from one: resourceVersion bumps on each write, a
PUT with a stale resourceVersion is a 409 Conflict Status, a missing Lease a 404 Status).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest
from kubernetes import client

from cachemgr.fleet.coordinator import LeaderRecord
from cachemgr.fleet.elector import Elector
from cachemgr.fleet.kube import URL_ANNOTATION, KubeCoordinator

PATH = "/apis/coordination.k8s.io/v1/namespaces/inference/leases"


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": {"name": "cachemgr-gc", "group": "coordination.k8s.io", "kind": "leases"},
        "code": code,
    }


class RecordedApiServer(BaseHTTPRequestHandler):
    lease: ClassVar[dict[str, Any] | None] = None
    version = 1000
    lock = threading.Lock()
    requests: ClassVar[list[str]] = []

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        return data

    def _stored(self, body: dict[str, Any]) -> dict[str, Any]:
        cls = type(self)
        cls.version += 1
        meta = {**body.get("metadata", {}), "resourceVersion": str(cls.version)}
        meta.setdefault("uid", "6f1c3a52-2b7e-4f0e-9d7c-1a0b5c3d9e21")
        meta.setdefault("creationTimestamp", "2026-12-01T16:00:00Z")
        cls.lease = {
            "kind": "Lease",
            "apiVersion": "coordination.k8s.io/v1",
            **body,
            "metadata": meta,
        }
        return cls.lease

    def do_GET(self) -> None:
        with self.lock:
            self.requests.append(f"GET {self.path}")
            if self.path != f"{PATH}/cachemgr-gc" or self.lease is None:
                self._send(404, status(404, "NotFound", 'leases "cachemgr-gc" not found'))
            else:
                self._send(200, self.lease)

    def do_POST(self) -> None:
        with self.lock:
            self.requests.append(f"POST {self.path}")
            if self.lease is not None:
                self._send(409, status(409, "AlreadyExists", 'leases "cachemgr-gc" already exists'))
            else:
                self._send(201, self._stored(self._body()))

    def do_PUT(self) -> None:
        with self.lock:
            self.requests.append(f"PUT {self.path}")
            body = self._body()
            sent = body.get("metadata", {}).get("resourceVersion")
            if self.lease is None or sent != self.lease["metadata"]["resourceVersion"]:
                msg = (
                    'Operation cannot be fulfilled on leases.coordination.k8s.io "cachemgr-gc": '
                    "the object has been modified; please apply your changes to the latest "
                    "version and try again"
                )
                self._send(409, status(409, "Conflict", msg))
            else:
                self._send(200, self._stored(body))


@pytest.fixture
def api() -> Iterator[str]:
    RecordedApiServer.lease, RecordedApiServer.requests = None, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), RecordedApiServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def coordinator(
    url: str, ttl: float = 2.0, clock: Callable[[], float] = time.time
) -> KubeCoordinator:
    conf = client.Configuration(host=url)
    return KubeCoordinator(
        client.CoordinationV1Api(client.ApiClient(conf)), "cachemgr-gc", "inference", ttl, clock
    )


def test_one_node_takes_the_lease_the_other_waits_until_it_expires(api: str) -> None:
    a, b = coordinator(api), coordinator(api)
    try:
        rec_a, rec_b = LeaderRecord("node-a", "http://10.0.0.1:9477"), LeaderRecord("node-b", "")
        term = a.campaign(rec_a)
        assert term is not None and a.holds(term)
        assert b.campaign(rec_b) is None
        assert b.leader() == rec_a  # the URL came back from the annotation
        assert RecordedApiServer.lease is not None
        assert RecordedApiServer.lease["metadata"]["annotations"][URL_ANNOTATION] == rec_a.url
        renewed = a.renew(term)
        assert renewed is not None and renewed.token != term.token and not a.holds(term)
        assert b.leader() == rec_a  # b sees the renewal: the duration counts from here
        time.sleep(2.5)  # past leaseDurationSeconds without a renewal
        taken = b.campaign(rec_b)
        assert taken is not None
        assert not a.holds(renewed) and a.renew(renewed) is None  # the fence says no
        assert RecordedApiServer.lease["spec"]["leaseTransitions"] == 1
        b.resign(taken)
        assert b.leader() is None
    finally:
        a.close()
        b.close()


def test_a_lost_race_is_a_conflict_not_a_second_leader(api: str) -> None:
    a, b = coordinator(api, ttl=30), coordinator(api, ttl=30)
    try:
        term = a.campaign(LeaderRecord("node-a", ""))
        assert term is not None
        stale = client.CoordinationV1Api(a.api.api_client).read_namespaced_lease(
            "cachemgr-gc", "inference"
        )
        assert a.renew(term) is not None  # bumps resourceVersion
        stale.spec.holder_identity = "node-b"
        assert b._write(stale) is None  # a PUT of what it read before: 409
        assert RecordedApiServer.lease is not None
        assert RecordedApiServer.lease["spec"]["holderIdentity"] == "node-a"
    finally:
        a.close()
        b.close()


def test_the_elector_leads_through_a_lease(api: str) -> None:
    el = Elector(coordinator(api), LeaderRecord("node-a", "http://x"), renew_interval=0.2)
    el.round()
    assert el.leading() and el.fence()
    el.round()
    assert el.leading() and el.fence()
    el.start()
    el.stop(5)  # resigns: the lease is free at once
    assert coordinator(api).leader() is None


def test_a_node_whose_clock_jumped_ahead_does_not_take_a_live_lease(api: str) -> None:
    # Expiry compared the holder's renewTime with this node's wall clock: a node an hour
    # ahead (an NTP step, a VM resumed) saw every live lease expired and took it at once.
    a = coordinator(api)
    ahead = coordinator(api, clock=lambda: time.time() + 3600)
    behind = coordinator(api, clock=lambda: time.time() - 3600)
    try:
        rec_a = LeaderRecord("node-a", "http://10.0.0.1:9477")
        term = a.campaign(rec_a)
        assert term is not None
        assert ahead.campaign(LeaderRecord("node-b", "")) is None
        assert ahead.leader() == rec_a
        assert a.holds(term)
        # and a holder whose clock is behind keeps its lease while it renews it
        a.close()
        a = behind
        lagging = a.campaign(LeaderRecord("node-a", ""))  # its own: taken again
        assert lagging is not None
        for _ in range(3):
            time.sleep(1)
            renewed = a.renew(lagging)
            assert renewed is not None
            lagging = renewed
            assert ahead.campaign(LeaderRecord("node-b", "")) is None
        time.sleep(2.5)  # and once it stops renewing, the lease is free after its duration
        assert ahead.campaign(LeaderRecord("node-b", "")) is not None
    finally:
        a.close()
        ahead.close()
