"""What the serving daemon says of its fleet (GET /v1/fleet): a coordinator it cannot reach, no
lease holder, or accesses that do not reach the leader. Each leaves the fleet's caps unkept or
its eviction order blind while every node serves on as if all were well."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cachemgr.doctor.finding import Finding
from cachemgr.fleet.accesses import SILENT

_COORDINATOR_FIX = (
    "check that this node reaches the coordinator fleet_coordinator names (etcd: its client "
    "port; kubernetes: the API server and the Role on leases); "
    "cachemgr_fleet_coordinator_up is 0 meanwhile"
)
_NO_LEADER_FIX = (
    "check each node's GET /v1/fleet and cachemgr_fleet_coordinator_up; an election takes up "
    "to fleet_lease_ttl plus fleet_renew_interval, so ask again after it"
)
_SHIP_FIX = (
    "check that this node reaches the leader's URL (its fleet_advertise_url) and that every "
    "node has the same token; cachemgr_fleet_ship_age_seconds shows it"
)
_SILENT_FIX = (
    "check that node's daemon runs, reaches this one (fleet_advertise_url) and has the same "
    "token; a node gone for good leaves the list after an hour"
)


def lint_fleet(fleet: Mapping[str, Any] | None) -> list[Finding]:
    """The fleet's problems as the daemon serving the root sees them; none off a fleet."""
    if not fleet or not fleet.get("enabled"):
        return []
    if not fleet.get("coordinator_up"):
        what = (
            f"this node ({fleet.get('node')}) gets no answer from the fleet's coordinator: it "
            "cannot lead GC, and while no node reaches it no node deletes and the caps are not kept"
        )
        return [Finding("error", "fleet-coordinator-down", what, _COORDINATOR_FIX)]
    if not fleet.get("leader"):
        what = "no node holds the fleet's GC lease now: nothing is deleted and caps are not kept"
        return [Finding("error", "fleet-no-leader", what, _NO_LEADER_FIX)]
    if fleet.get("leading"):
        return [_silent(n) for n in fleet.get("nodes") or [] if _age(n, "last_summary") > SILENT]
    return [_not_shipping(fleet)] if _age(fleet, "ship") > SILENT else []


def _age(seen: Mapping[str, Any], what: str) -> float:
    return float(seen.get(f"{what}_age_seconds") or 0.0)


def _not_shipping(fleet: Mapping[str, Any]) -> Finding:
    return Finding(
        "warning",
        "fleet-not-shipping",
        f"the GC leader ({fleet.get('leader')} at {fleet.get('leader_url')}) took none of this "
        f"node's accesses for {_age(fleet, 'ship'):.0f} s: its eviction order misses this "
        "node's reads and stores, so pages hot here are evicted first",
        _SHIP_FIX,
    )


def _silent(node: Mapping[str, Any]) -> Finding:
    return Finding(
        "warning",
        "fleet-node-silent",
        f"the leader has heard nothing from node {node.get('node')} for "
        f"{_age(node, 'last_summary'):.0f} s: its accesses do not reach GC's order",
        _SILENT_FIX,
    )
