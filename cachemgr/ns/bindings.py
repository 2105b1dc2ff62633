"""Instance bindings on disk: <root>/ns/<instance>.bind names the namespace a server uses.

Every reader asks the state DB's `bindings` table; these files are its durable copy beside the
manifests. The DB can be lost, found corrupt and moved aside, or deleted under the daemon, and
is then rebuilt from disk: without the files every namespace would come back unbound, and GC
would drop namespaces that servers still use.

- `namespaces.bind` writes the file inside the DB transaction, before its commit: a failed
  write leaves the DB as it was.
- While the DB has an instance's binding, the DB wins: a file that is absent (a root bound by
  an older cachemgr) or names another namespace (an init that died before its commit) is
  rewritten from it, under the root lock, so a concurrent init is never undone.
- An instance the DB does not know is bound from its file (`restore`), in the transaction
  that registers the namespaces found on disk: GC never sees them unbound in between.
- cachemgr never unbinds an instance (it only moves it), so it never deletes these files; they
  are never namespaces (a namespace is 16 hex digits, these end in .bind), and GC, purge, ls
  and doctor only ever look at namespace names.

In a fleet (docs/fleet.md) the files are also how nodes learn each other's bindings: the shared
root is the one store they all see (each state DB is node-local). An instance's name carries
its node (`qualify`: `sglang@node-a`), so each node writes only its own instances' files and
two nodes' servers of one name are two instances. The DB mirrors every node's bindings: its own
as above (the DB wins), the other nodes' from their files (the files win: another node's init
moved them), read in by `adopt_from_disk`, by `catch_up` before init counts who still uses the
namespace it leaves, and before each GC plan and purge, and by `read_in` once more as a purge
moves each namespace (the root lock is one node's: another node may bind while a plan is made),
and after the move of an unbound one (`ns.purge.rebound`: a bind since that last read).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from dataclasses import dataclass

from cachemgr.errors import (
    CachemgrError,
    ConfigError,
    ConflictError,
    StateError,
    UnsafePathError,
)
from cachemgr.fs.locks import root_lock
from cachemgr.fs.safe import open_dir, read_regular, write_atomic_at
from cachemgr.layout import BIND_SUFFIX, INSTANCE_RE, NS_DIR, NS_ID_RE, Layout, check_instance
from cachemgr.ns.manifest import timestamp
from cachemgr.state import registry_sql
from cachemgr.state.store import Store

log = logging.getLogger(__name__)
BIND_VERSION = 1
BIND_MAX_BYTES = 4096  # a real one is ~100 bytes
NODE_MARK = "@"  # between an instance's name and its node's in a fleet
REPAIR_LOCK_WAIT = 1.0  # s; a busy root lock (an init binding right now) leaves it to next time


@dataclass(frozen=True)
class Binding:
    """What ns/<instance>.bind holds."""

    instance: str
    ns_id: str
    bound_at: float

    def to_bytes(self) -> bytes:
        data = {
            "version": BIND_VERSION,
            "instance": self.instance,
            "ns_id": self.ns_id,
            "bound_at": self.bound_at,
        }
        return (json.dumps(data, sort_keys=True) + "\n").encode()


def write_binding(layout: Layout, binding: Binding) -> None:
    """Write ns/<instance>.bind atomically; a symlink planted there is replaced, not followed."""
    path = layout.binding(binding.instance)
    try:
        with open_dir(layout.root, NS_DIR) as fd:
            write_atomic_at(fd, path.name, binding.to_bytes())
    except OSError as e:
        raise ConfigError(f"cannot write binding {path}: {e.strerror or e}") from e


def read_bindings(layout: Layout) -> tuple[dict[str, Binding], list[str]]:
    """(instance → its binding file, problems): a file that is not a regular one, too large,
    or not a valid binding is a problem, not a binding."""
    found: dict[str, Binding] = {}
    problems: list[str] = []
    try:
        with open_dir(layout.root, NS_DIR) as fd:
            names = [n for n in os.listdir(fd) if n.endswith(BIND_SUFFIX)]
            for name in sorted(names):
                instance = name.removesuffix(BIND_SUFFIX)
                if not INSTANCE_RE.fullmatch(instance):
                    continue  # not a name cachemgr writes
                try:
                    raw = read_regular(fd, name, BIND_MAX_BYTES)
                    found[instance] = parse_binding(raw, instance)
                except FileNotFoundError:
                    continue
                except (UnsafePathError, StateError) as e:
                    problems.append(f"{layout.binding(instance)}: {e}")
    except FileNotFoundError:
        pass
    return found, problems


def parse_binding(raw: bytes, instance: str) -> Binding:
    """Validate a binding file's bytes, strictly; StateError saying what is wrong."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise StateError(f"not JSON: {e}") from e
    if not isinstance(data, dict) or data.get("version") != BIND_VERSION:
        raise StateError(f"not a binding of version {BIND_VERSION}")
    if data.get("instance") != instance:
        raise StateError(f"names instance {data.get('instance')!r:.40}, not {instance}")
    ns_id = data.get("ns_id")
    if not isinstance(ns_id, str) or not NS_ID_RE.fullmatch(ns_id):
        raise StateError(f"ns_id {ns_id!r:.40} is not a namespace id")
    return Binding(instance, ns_id, timestamp(data, "bound_at", "binding"))


def db_bindings(store: Store) -> dict[str, Binding]:
    """instance → binding, as the DB has them."""
    return {i: Binding(i, ns, at) for i, ns, at in registry_sql.all_bindings(store.conn)}


def qualify(layout: Layout, instance: str) -> str:
    """The instance's name in the root: in a fleet, `<instance>@<node>` (a name that has an
    @ already names its node: `purge --instance sglang@node-b` from node a); else `instance`."""
    check_instance(instance)
    if layout.node is None or NODE_MARK in instance:
        return instance
    qualified = f"{instance}{NODE_MARK}{layout.node}"
    if not INSTANCE_RE.fullmatch(qualified):
        raise ConfigError(
            f"instance {instance!r} on node {layout.node!r}: {qualified!r} is over 128 "
            "characters; use a shorter instance or node_name"
        )
    return qualified


def owned(layout: Layout, instance: str) -> bool:
    """Whether this node writes `instance`'s binding file (all of them outside a fleet)."""
    return layout.node is None or instance.endswith(NODE_MARK + layout.node)


def behind(layout: Layout, store: Store, files: dict[str, Binding]) -> list[Binding]:
    """The binding files the DB is behind on: instances it does not know, and (in a fleet)
    other nodes' instances whose file names another namespace than the DB has."""
    in_db = db_bindings(store)
    return [
        b
        for inst, b in sorted(files.items())
        if inst not in in_db or (not owned(layout, inst) and in_db[inst].ns_id != b.ns_id)
    ]


def restore(layout: Layout, store: Store, files: list[Binding]) -> list[str]:
    """Bind each instance as its file says, if the namespace is registered (its manifest was
    read). Call inside a transaction; returns those bound.

    This node's instances are bound only if the DB has none meanwhile (an init: the file may
    be older); another node's follow its file, which that node alone writes."""
    restored = []
    for b in files:
        if owned(layout, b.instance):
            done = registry_sql.bind_if_new(store.conn, b.instance, b.ns_id, b.bound_at)
        else:
            done = registry_sql.rebind(store.conn, b.instance, b.ns_id, b.bound_at)
        if done:
            restored.append(b.instance)
    return restored


def catch_up(layout: Layout, store: Store) -> list[str]:
    """Read in the binding files the DB is behind on (in a fleet: the other nodes' moves), in
    a transaction of its own; returns the instances bound."""
    late = _late(layout, store)
    if not late:
        return []
    with store.transaction():
        return restore(layout, store, late)


def read_in(layout: Layout, store: Store) -> list[str]:
    """`catch_up` inside the caller's transaction (a purge's, right before it moves a dir)."""
    return restore(layout, store, _late(layout, store))


def _late(layout: Layout, store: Store) -> list[Binding]:
    """The binding files the DB is behind on."""
    return behind(layout, store, read_bindings(layout)[0])


def _stale(layout: Layout, store: Store, files: dict[str, Binding]) -> list[Binding]:
    """This node's bindings in the DB whose file is absent, damaged, or names another
    namespace."""
    return [
        b
        for inst, b in sorted(db_bindings(store).items())
        if owned(layout, inst) and (inst not in files or files[inst].ns_id != b.ns_id)
    ]


def write_down(layout: Layout, store: Store, files: dict[str, Binding]) -> None:
    """Rewrite from the DB every binding file of this node's that differs from it (see the
    module docstring).

    Checked again under the root lock: an init may have bound between our reads of the DB
    and of the files. A failure is logged, never raised: the DB still serves, and the next
    command tries again."""
    if not _stale(layout, store, files):
        return
    try:
        with root_lock(layout, timeout=REPAIR_LOCK_WAIT):
            for binding in _stale(layout, store, read_bindings(layout)[0]):
                write_binding(layout, binding)
                log.info(
                    "binding written down from the state DB",
                    extra={"instance": binding.instance, "ns": binding.ns_id},
                )
    except ConflictError:  # an init or purge holds it: it is binding right now
        log.info("binding files not brought in line with the state DB: root lock busy")
    except CachemgrError as e:
        log.warning(
            "binding files not brought in line with the state DB; retried next time",
            extra={"error": str(e)},
        )


def bound_now(layout: Layout, conn: sqlite3.Connection) -> dict[str, tuple[str, ...]]:
    """namespace id → the instances bound to it, sorted: the DB's, with the binding files it
    is behind on read over them as `catch_up` would (in a fleet, the moves other nodes made
    since this DB last read the files: a daemon's mirror is otherwise as of its start). For
    status: reads the files, writes nothing."""
    bound = {inst: ns for inst, ns, _ in registry_sql.all_bindings(conn)}
    for inst, b in read_bindings(layout)[0].items():
        if inst not in bound or not owned(layout, inst):
            bound[inst] = b.ns_id
    out: dict[str, list[str]] = {}
    for inst in sorted(bound):
        out.setdefault(bound[inst], []).append(inst)
    return {ns: tuple(insts) for ns, insts in out.items()}


def bound_by_files(layout: Layout) -> set[str]:
    """The namespaces some binding file names (GC's last check before dropping one)."""
    return {b.ns_id for b in read_bindings(layout)[0].values()}
