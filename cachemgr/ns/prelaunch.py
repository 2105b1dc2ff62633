"""The pre-launch step: give an identity its namespace, bind the instance, apply the change policy.

`init_namespace` is what `cachemgr init` and `cachemgr exec` run before the server starts: the
server must never start against pages written under another identity.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, TypeVar

from cachemgr.errors import ConfigError, StateError, UnsafePathError
from cachemgr.fs.locks import root_lock
from cachemgr.fs.root import create_root
from cachemgr.identity.engines import parse_identity
from cachemgr.identity.record import Digested, diff_identities
from cachemgr.layout import Layout
from cachemgr.ns import bindings
from cachemgr.ns import registry as nsreg
from cachemgr.ns.liveuse import live_users
from cachemgr.ns.manifest import read_manifest
from cachemgr.ns.purge import execute_purge, plan_purge
from cachemgr.ns.purge_plan import page_counter
from cachemgr.state.store import Store

OnChange = Literal["purge", "retain"]
IdentityT = TypeVar("IdentityT", bound=Digested)
Outcome = Literal["created", "joined", "unchanged", "changed"]
OldAction = Literal["purged", "retained", "kept"]


@dataclass(frozen=True)
class InitResult:
    """What init did; the CLI turns it into one line (or JSON)."""

    instance: str
    ns_id: str
    digest: str
    storage_dir: Path
    outcome: Outcome  # created: new namespace; joined: an existing one this instance was not on
    created_dir: bool
    previous_ns: str | None = None  # the namespace the instance was bound to before
    changes: tuple[str, ...] = ()  # how the identity changed, e.g. "kv_cache_dtype: a → b"
    old_action: OldAction | None = None  # kept: another instance still uses the old namespace
    old_users: tuple[str, ...] = ()
    old_pages: int = 0
    old_bytes: int = 0


def init_namespace(
    layout: Layout,
    store: Store,
    identity: Digested,
    *,
    instance: str = "default",
    on_change: OnChange = "purge",
    now: Callable[[], float] = time.time,
    force: bool = False,
    in_use: Callable[[Path], list[int]] = live_users,
) -> InitResult:
    """Create/refresh the identity's namespace, bind `instance` to it, handle the old one.

    The old namespace's files are only renamed into .trash/ here; deleting them is the
    caller's choice (`drain_trash` now, or later by the daemon). A purge of a namespace a
    running process on this host still uses as its storage dir is refused unless `force`.
    """
    nsreg.check_instance(instance)
    create_root(layout)
    ns = identity.ns_id
    with root_lock(layout):
        previous = nsreg.binding_of(store, instance)
        if previous not in (None, ns) and on_change == "purge" and not force:
            _refuse_live_purge(layout, store, previous, instance, in_use)
        record = identity.model_dump(mode="json")

        def ensure() -> bool:
            return nsreg.ensure_namespace(
                layout, store, ns_id=ns, digest=identity.digest, identity=record, now=now()
            )

        created = ensure()
        with store.transaction():
            nsreg.bind(layout, store, instance, ns, now())
        if layout.node is not None:
            # Another node's purge may have read the binding files just before this one was
            # written, and moved the dir away since: made again now if so (ns.purge.rebound).
            ensure()
        base = InitResult(instance, ns, identity.digest, layout.ns_dir(ns), "created", created)
        if previous is None:
            return replace(base, outcome="created" if created else "joined")
        if previous == ns:
            return replace(base, outcome="unchanged", previous_ns=ns)
        changes = tuple(_changes(layout, store, previous, identity))
        if layout.node is not None:  # another node's server may have left it meanwhile
            bindings.catch_up(layout, store)
        users = nsreg.instances_of(store, previous)
        changed = replace(base, outcome="changed", previous_ns=previous, changes=changes)
        if on_change == "purge" and not users:
            # Checked above, before the bind; --force takes the dir from a live server too.
            users_of = _nobody if force else in_use
            try:
                plan = plan_purge(layout, store, namespace=previous, in_use=users_of)
            except UnsafePathError:  # damaged (nsreg.damaged): left alone, ls/doctor say why
                return replace(changed, old_action="retained")
            execute_purge(
                plan,
                layout,
                store,
                actor="cli",
                reason="identity_change",
                now=now,
                in_use=users_of,
            )
            return replace(changed, old_action="purged", old_pages=plan.pages, old_bytes=plan.bytes)
        pages, size = page_counter(layout, store)(previous)
        action: OldAction = "kept" if users else "retained"
        return replace(changed, old_action=action, old_users=users, old_pages=pages, old_bytes=size)


def _nobody(ns_dir: Path) -> list[int]:
    """No process counts as using a dir (init --force)."""
    return []


def _refuse_live_purge(
    layout: Layout,
    store: Store,
    old_ns: str,
    instance: str,
    in_use: Callable[[Path], list[int]],
) -> None:
    """Raise if the purge would pull a namespace from under a live server (checked before
    anything is bound or moved, so a refusal leaves the root as it was)."""
    if any(u != instance for u in nsreg.instances_of(store, old_ns)):
        return  # another instance keeps it: it will not be purged anyway
    pids = in_use(layout.ns_dir(old_ns))
    if pids:
        raise ConfigError(
            f"instance {instance}'s old ns {old_ns} is in use by running process "
            f"{', '.join(map(str, pids[:3]))} (its storage dir): another server on this "
            "root? give each server its own --instance, or pass --on-change retain; --force "
            "purges anyway"
        )


def adopt_known_version(store: Store, instance: str, identity: Digested) -> Digested:
    """An identity whose engine version is unknown here takes the version of the namespace
    the instance is bound to, when that is the only difference.

    `init` often runs where the engine is not installed (an initContainer) and `exec` where
    it is; without this the two entry points would disagree on the namespace and purge a
    valid cache each time they alternate. A detected or explicit version is never replaced.
    """
    if identity.engine_version != "unknown":
        return identity
    bound = nsreg.binding_of(store, instance)
    raw = nsreg.identity_json(store, bound) if bound else None
    old = _parse(raw) if raw is not None else None
    return identity if old is None else with_version_of(identity, old)


def with_version_of(identity: IdentityT, old: Digested) -> IdentityT:
    """`identity` with `old`'s engine version if its own is unknown and that is the only
    difference (see adopt_known_version), else `identity` unchanged."""
    if (
        type(old) is not type(identity)
        or identity.engine_version != "unknown"
        or old.engine_version == identity.engine_version
    ):
        return identity
    adopted = identity.with_engine_version(old.engine_version, old.engine_version_full)
    return adopted if adopted.digest == old.digest else identity  # type: ignore[return-value]


def _parse(raw: str) -> Digested | None:
    """An identity record from the DB's JSON copy; None if another schema wrote it."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return parse_identity(data) if isinstance(data, dict) else None


def _changes(layout: Layout, store: Store, old_ns: str, new: Digested) -> list[str]:
    """How the identity changed since `old_ns`, from its DB row or manifest."""
    raw = nsreg.identity_json(store, old_ns)
    if raw is None:
        try:
            manifest = read_manifest(layout, old_ns)
        except StateError:
            manifest = None  # damaged: say only that it changed
        raw = json.dumps(manifest.identity) if manifest else None
    old = _parse(raw) if raw is not None else None
    if old is not None:  # else written by another schema version: say only that it changed
        return diff_identities(old, new)
    return [f"identity: {old_ns} → {new.ns_id}"]
