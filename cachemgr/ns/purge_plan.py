"""Planning a purge: which namespaces a selector picks, and what each holds now (purge.py
executes the plan)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

from cachemgr.errors import ConfigError, NotFoundError, UnsafePathError
from cachemgr.fs.dirscan import scan_usage
from cachemgr.fs.leadership import index_live
from cachemgr.layout import Layout, check_ns_id
from cachemgr.ns import registry as nsreg
from cachemgr.ns.bindings import qualify
from cachemgr.ns.liveuse import live_users
from cachemgr.ns.manifest import format_of
from cachemgr.ns.runcontext import DirUsers
from cachemgr.ns.trash import list_trash
from cachemgr.state import pages_sql
from cachemgr.state.status import bindings_by_namespace
from cachemgr.state.store import Store


@dataclass(frozen=True)
class PurgeTarget:
    """One namespace a plan would purge, with what it holds now."""

    ns_id: str
    pages: int
    bytes: int
    instances: tuple[str, ...]  # bound now: its dir is recreated empty
    has_dir: bool
    has_manifest: bool
    # Unbound, but running processes on this host use its dir as their storage dir (a server
    # whose instance was moved with --on-change retain): its dir is recreated empty too.
    users: tuple[int, ...] = ()

    @property
    def kept(self) -> bool:
        """Whether its dir comes back empty, with its manifest (someone uses it)."""
        return bool(self.instances or self.users)


@dataclass(frozen=True)
class PurgePlan:
    """What a purge would do: the namespaces, and trash left by earlier runs to finish."""

    targets: tuple[PurgeTarget, ...]
    trash: tuple[str, ...]
    selector: str
    only_unbound: bool = False  # a target bound since the plan was made is then skipped
    problems: tuple[str, ...] = ()  # selected namespaces left alone (nsreg.damaged), and why
    indexed: bool = False  # its counts are a live index's (read again as each target moves)

    @property
    def pages(self) -> int:
        return sum(t.pages for t in self.targets)

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.targets)


class Selector(TypedDict, total=False):
    """Which namespaces a purge takes: exactly one of these."""

    namespace: str | None  # this one
    instance: str | None  # the one this instance is bound to
    all: bool  # every namespace
    unbound: bool  # those no instance is bound to


def plan_purge(
    layout: Layout,
    store: Store,
    *,
    namespace: str | None = None,
    instance: str | None = None,
    all: bool = False,
    unbound: bool = False,
    count: bool = True,
    in_use: DirUsers = live_users,
) -> PurgePlan:
    """Which namespaces a purge selects; exactly one selector. Each target's pages and bytes
    are the live index's where a daemon indexes the root on this kernel (a scan of 10M pages
    took 127 s before the rename), else a scan's; `count=False` skips the scan. `unbound`
    leaves out, as a problem, a namespace a running process uses (`in_use`), as GC does."""
    chosen = [namespace is not None, instance is not None, all, unbound]
    if sum(chosen) != 1:
        raise ConfigError("choose exactly one of --namespace, --instance, --all, --unbound")
    dirs, manifests = nsreg.on_disk(layout)
    bound = bindings_by_namespace(store.conn)
    damaged = nsreg.damaged(layout)
    if namespace is not None:
        ids = [check_ns_id(namespace)]
        if namespace not in dirs | manifests | set(bound):
            raise NotFoundError(f"no namespace {namespace} under {layout.ns_root}")
        if namespace in damaged:
            raise UnsafePathError(f"ns {namespace} is left alone: {damaged[namespace][1]}")
        selector = f"namespace {namespace}"
    elif instance is not None:
        instance = qualify(layout, instance)  # in a fleet: this node's, unless it names one
        ns = nsreg.binding_of(store, instance)
        if ns is None:
            raise NotFoundError(f"instance {instance!r} is not bound to a namespace")
        ids, selector = [ns], f"instance {instance}"
    elif all:
        ids, selector = sorted(dirs | manifests | set(bound)), "all"
    else:
        ids, selector = sorted((dirs | manifests) - set(bound)), "unbound"
    # A damaged namespace is skipped and reported; the others are purged all the same.
    problems = [f"ns/{ns}: {damaged[ns][1]}" for ns in ids if ns in damaged]
    users = {ns: tuple(in_use(layout.ns_dir(ns))) for ns in ids if ns in dirs and ns not in bound}
    if unbound:  # not unused after all: a server started before its instance moved
        problems += [f"ns/{ns}: {in_use_note(pids)}" for ns, pids in users.items() if pids]
        ids = [ns for ns in ids if not users.get(ns)]
    indexed = indexed_counter(layout, store)
    counter = indexed or (_scanner(layout) if count else None)
    targets = tuple(
        _target(layout, ns, bound.get(ns, ()), ns in manifests, counter, users.get(ns, ()))
        for ns in ids
        if ns not in damaged
    )
    trash = tuple(list_trash(layout))
    return PurgePlan(
        targets,
        trash,
        selector,
        only_unbound=unbound,
        problems=tuple(problems),
        indexed=indexed is not None,
    )


Counter = Callable[[str], tuple[int, int]]  # namespace id -> (pages, bytes)


def in_use_note(pids: tuple[int, ...] | list[int]) -> str:
    """`in use by running process 123 (its storage dir)`: why a purge keeps a dir."""
    return f"in use by running process {', '.join(map(str, pids[:3]))} (its storage dir)"


def page_counter(layout: Layout, store: Store) -> Counter:
    """How to count what a namespace holds: the live index's counts, else a scan of its dir."""
    return indexed_counter(layout, store) or _scanner(layout)


def indexed_counter(layout: Layout, store: Store) -> Counter | None:
    """The live index's counts, where a daemon indexes the root on this kernel (None: none
    does). In a fleet each node's daemon indexes what its own kernel sees: None."""
    if layout.node is None and index_live(layout):
        return lambda ns_id: pages_sql.namespace_usage(store.conn, ns_id)
    return None


def _scanner(layout: Layout) -> Counter:
    """Counts of a namespace by a scan of its dir."""

    def scanned(ns_id: str) -> tuple[int, int]:
        usage = scan_usage(layout, f"ns/{ns_id}", format_of(layout, ns_id))
        return (usage.pages, usage.bytes) if usage else (0, 0)

    return scanned


def _target(
    layout: Layout,
    ns_id: str,
    instances: tuple[str, ...],
    has_manifest: bool,
    counter: Counter | None,
    users: tuple[int, ...],
) -> PurgeTarget:
    has_dir = nsreg.ns_entry_kind(layout, ns_id) == "dir"  # refuses a symlink before any change
    pages, size = counter(ns_id) if has_dir and counter else (0, 0)
    return PurgeTarget(ns_id, pages, size, instances, has_dir, has_manifest, users)
