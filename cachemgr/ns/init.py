"""The pre-launch workflow `init` and `exec` run: the identity's namespace, old one purged."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from cachemgr.fs.deletion import DeleteReport
from cachemgr.identity.record import Digested
from cachemgr.layout import Layout
from cachemgr.ns.bindings import qualify
from cachemgr.ns.prelaunch import (
    InitResult,
    OnChange,
    adopt_known_version,
    init_namespace,
)
from cachemgr.ns.root import opened_store
from cachemgr.state.notices import first_time
from cachemgr.state.store import Store

Drain = Callable[[Layout, Store], DeleteReport]


@dataclasses.dataclass(frozen=True)
class InitRun:
    """An init that ran: its result, the identity used (its version possibly adopted from
    the instance's namespace), what to warn about."""

    result: InitResult
    identity: Digested
    trash_refused: tuple[str, ...]
    # The version was borrowed from the instance's namespace, and this root has been told so
    # before: a host where init runs apart from the engine (an initContainer) would otherwise
    # hear it on every start. An 'unknown' version is never "told": it is said every time.
    engine_missing_told: bool = False


def engine_missing(identity: Digested) -> bool:
    """Whether no installed engine (nor an option) gave the identity its engine version: it
    is 'unknown', or borrowed from the instance's namespace."""
    return identity.engine_version == "unknown" or identity.engine_version_from == "namespace"


def run_init(
    layout: Layout,
    identity: Digested,
    *,
    instance: str,
    on_change: OnChange,
    force: bool = False,
    drain: Drain | None = None,
) -> InitRun:
    """Init the identity's namespace for `instance`; `drain` deletes what was purged now."""
    instance = qualify(layout, instance)  # in a fleet: this node's instance of that name
    with opened_store(layout) as store:
        identity = adopt_known_version(store, instance, identity)
        result = init_namespace(
            layout, store, identity, instance=instance, on_change=on_change, force=force
        )
        refused: tuple[str, ...] = ()
        if drain is not None and result.old_action == "purged":
            refused = drain(layout, store).refused
        notice = f"{identity.ENGINE}-missing"  # "sglang-missing" as before vLLM came
        borrowed = identity.engine_version_from == "namespace"
        told = borrowed and not first_time(store, notice, time.time())
    return InitRun(result, identity, refused, told)
