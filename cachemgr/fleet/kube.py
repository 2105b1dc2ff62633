"""The lease as a `coordination.k8s.io/v1` Lease in the pod's namespace, through the official
Kubernetes client (CoordinationV1Api), the way client-go's leader election uses one.

Every write carries the resourceVersion it read (optimistic concurrency: the API server
answers 409 to a writer that lost a race), so the term's token is the resourceVersion of this
node's last write: any other write to the Lease, by another node taking it over, changes it.
The leader's URL rides in an annotation; `holderIdentity` is the node's name.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from cachemgr.errors import ConfigError
from cachemgr.fleet.coordinator import CoordinatorDown, LeaderRecord, Term

URL_ANNOTATION = "cachemgr.io/leader-url"
POD_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
TIMEOUT = 2.0


def namespace_of_pod(path: Path = POD_NAMESPACE) -> str:
    """The namespace this pod runs in ("default" outside a cluster)."""
    try:
        return path.read_text().strip() or "default"
    except OSError:
        return "default"


class KubeCoordinator:
    """One Lease, `name` in `namespace`, through `api`."""

    def __init__(
        self,
        api: client.CoordinationV1Api,
        name: str,
        namespace: str,
        ttl: float,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api, self.name, self.namespace = api, name, namespace
        self.ttl, self.clock, self.monotonic = ttl, clock, monotonic
        # The Lease's resourceVersion as this node last saw it change, and when by its own
        # monotonic clock. A Lease expires leaseDurationSeconds after this node saw its last
        # write (client-go's observedTime), never by the holder's renewTime against this
        # node's wall clock: a clock stepped ahead (or a holder's behind) by more than the
        # duration took a live lease from its holder at once.
        self._seen: tuple[str, float] | None = None

    @classmethod
    def in_cluster(cls, name: str, namespace: str, ttl: float) -> KubeCoordinator:
        """Through the pod's service account (else ~/.kube/config)."""
        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        except ConfigException:
            try:
                config.load_kube_config()  # type: ignore[no-untyped-call]
            except (ConfigException, OSError) as e:  # not in a pod: a setting to fix, said once
                raise ConfigError(
                    'fleet_coordinator "kubernetes": no service account (not in a pod?) and '
                    f"no usable kube config: {e}"
                ) from e
        return cls(client.CoordinationV1Api(), name, namespace, ttl)

    def _call(self, op: Callable[[], Any]) -> Any:
        """`op()`; CoordinatorDown if the API server did not answer or refused (RBAC);
        ApiException for the statuses the caller handles (404, 409)."""
        try:
            return op()
        except ApiException as e:
            if e.status in (404, 409):
                raise
            raise CoordinatorDown(f"kubernetes: HTTP {e.status} {e.reason}") from e
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise CoordinatorDown(f"kubernetes: {e}") from e

    def _read(self) -> client.V1Lease | None:
        try:
            lease: client.V1Lease = self._call(
                lambda: self.api.read_namespaced_lease(
                    self.name, self.namespace, _request_timeout=TIMEOUT
                )
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise CoordinatorDown(f"kubernetes: HTTP {e.status}") from e
        return lease

    def _expired(self, lease: client.V1Lease) -> bool:
        spec = lease.spec
        if spec is None or not spec.holder_identity:
            return True
        now, version = self.monotonic(), _version(lease)
        if self._seen is None or self._seen[0] != version:
            self._seen = (version, now)
        return now - self._seen[1] > (spec.lease_duration_seconds or 0)

    def _spec(self, node: str | None, old: client.V1LeaseSpec | None) -> client.V1LeaseSpec:
        now = datetime.fromtimestamp(self.clock(), UTC)
        same = old is not None and old.holder_identity == node
        transitions = old.lease_transitions or 0 if old is not None else 0
        return client.V1LeaseSpec(
            holder_identity=node,
            lease_duration_seconds=max(1, math.ceil(self.ttl)),
            acquire_time=old.acquire_time if same and old is not None else now,
            renew_time=now,
            lease_transitions=transitions if same or old is None else transitions + 1,
        )

    def _write(self, lease: client.V1Lease) -> str | None:
        """Replace the Lease as read (its resourceVersion); the new version, None on a 409."""
        try:
            done: client.V1Lease = self._call(
                lambda: self.api.replace_namespaced_lease(
                    self.name, self.namespace, lease, _request_timeout=TIMEOUT
                )
            )
        except ApiException:
            return None  # 409: another writer got there first; 404: deleted meanwhile
        return _version(done)

    def campaign(self, record: LeaderRecord) -> Term | None:
        lease = self._read()
        if lease is None:
            return self._create(record)
        spec = lease.spec
        if spec is not None and spec.holder_identity != record.node and not self._expired(lease):
            return None
        lease.spec = self._spec(record.node, spec)
        meta = lease.metadata = lease.metadata or client.V1ObjectMeta()
        meta.annotations = {**(meta.annotations or {}), URL_ANNOTATION: record.url}
        version = self._write(lease)
        return None if version is None else Term(record, version)

    def _create(self, record: LeaderRecord) -> Term | None:
        body = client.V1Lease(
            metadata=client.V1ObjectMeta(
                name=self.name, namespace=self.namespace, annotations={URL_ANNOTATION: record.url}
            ),
            spec=self._spec(record.node, None),
        )
        try:
            made: client.V1Lease = self._call(
                lambda: self.api.create_namespaced_lease(
                    self.namespace, body, _request_timeout=TIMEOUT
                )
            )
        except ApiException:
            return None  # 409: another node created it first
        return Term(record, _version(made))

    def renew(self, term: Term) -> Term | None:
        lease = self._read()
        if lease is None or not self._is(lease, term):
            return None
        lease.spec = self._spec(term.record.node, lease.spec)
        version = self._write(lease)
        return None if version is None else Term(term.record, version)

    def _is(self, lease: client.V1Lease, term: Term) -> bool:
        # Nobody wrote the Lease since this node's last write: it is still this node's (the
        # elector stops leading by its own clock before another node may take it over).
        spec = lease.spec
        return (
            spec is not None
            and spec.holder_identity == term.record.node
            and _version(lease) == term.token
        )

    def holds(self, term: Term) -> bool:
        lease = self._read()
        return lease is not None and self._is(lease, term)

    def leader(self) -> LeaderRecord | None:
        lease = self._read()
        if lease is None or lease.spec is None or self._expired(lease):
            return None
        annotations = (lease.metadata.annotations if lease.metadata else None) or {}
        return LeaderRecord(str(lease.spec.holder_identity), annotations.get(URL_ANNOTATION, ""))

    def resign(self, term: Term) -> None:
        lease = self._read()
        if lease is not None and lease.spec is not None and self._is(lease, term):
            lease.spec.holder_identity = None  # client-go's ReleaseOnCancel does the same
            self._write(lease)

    def close(self) -> None:
        self.api.api_client.close()


def _version(lease: client.V1Lease) -> str:
    return str(lease.metadata.resource_version) if lease.metadata is not None else ""
