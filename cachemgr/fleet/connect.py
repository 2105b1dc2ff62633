"""The coordinator a setting names: etcd endpoints or the pod's Kubernetes API."""

from __future__ import annotations

from cachemgr.fleet.coordinator import Coordinator, parse_endpoints
from cachemgr.settings import Settings


def open_coordinator(settings: Settings) -> Coordinator:
    """The client for `fleet_coordinator` (set); nothing is asked of it yet."""
    value = settings.fleet_coordinator
    assert value is not None, "fleet mode is off"
    if value == "kubernetes":
        from cachemgr.fleet.kube import KubeCoordinator, namespace_of_pod

        namespace = settings.fleet_lease_namespace or namespace_of_pod()
        return KubeCoordinator.in_cluster(
            settings.fleet_lease_name, namespace, settings.fleet_lease_ttl
        )
    from cachemgr.fleet.etcd import EtcdCoordinator

    endpoints = parse_endpoints(value)
    return EtcdCoordinator(endpoints, settings.fleet_lease_name, settings.fleet_lease_ttl)
