"""The coordinator a setting names: etcd endpoints or the pod's Kubernetes API."""

from __future__ import annotations

from cachemgr.errors import ConfigError
from cachemgr.fleet.coordinator import Coordinator, LeaderRecord, parse_endpoints
from cachemgr.settings import Settings


def open_coordinator(settings: Settings) -> Coordinator:
    """The client for `fleet_coordinator` (set); nothing is asked of it yet."""
    value = settings.fleet_coordinator
    assert value is not None, "fleet mode is off"
    # The clients are an optional extra: without it, a line that says how to get it.
    try:
        if value == "kubernetes":
            from cachemgr.fleet.kube import KubeCoordinator, namespace_of_pod
        else:
            from cachemgr.fleet.etcd import EtcdCoordinator
    except ImportError as e:
        raise ConfigError(
            f"fleet_coordinator {value!r} needs the fleet extra "
            f"(pip install 'cachemgr[fleet]'): {e}"
        ) from e
    if value == "kubernetes":
        namespace = settings.fleet_lease_namespace or namespace_of_pod()
        return KubeCoordinator.in_cluster(
            settings.fleet_lease_name, namespace, settings.fleet_lease_ttl
        )
    endpoints = parse_endpoints(value)
    return EtcdCoordinator(endpoints, settings.fleet_lease_name, settings.fleet_lease_ttl)


def current_leader(settings: Settings) -> LeaderRecord | None:
    """Who holds the fleet's GC lease now, asked of its coordinator (CoordinatorDown: it did
    not answer); for a command outside the daemon."""
    coordinator = open_coordinator(settings)
    try:
        return coordinator.leader()
    finally:
        coordinator.close()
