"""A cache root with a real state DB and real page files whose times the test chooses."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachemgr.daemon.events import LOCAL, Kind
from cachemgr.daemon.page_events import PageEvents
from cachemgr.fs.root import create_root
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.execute import Recorded, execute_gc
from cachemgr.gc.pagestore import PageId
from cachemgr.gc.plan import GcPlan, Live, plan_gc
from cachemgr.gc.policy import GcPolicy
from cachemgr.gc.step import GcReport
from cachemgr.layout import Layout
from cachemgr.ns.runcontext import RunContext
from cachemgr.state.store import Store

NS = "0123456789abcdef"
NS2 = "fedcba9876543210"
T0 = time.time() - 30 * 86400  # fake clocks start in the past so file mtimes can match them


def page_bytes(d: Path) -> int:
    """Bytes of the page files (*.bin) under `d`, at any depth (vLLM's tier nests them). A file
    GC deletes between the listing and its stat is not on disk: it counts nothing."""
    total = 0
    for p in d.rglob("*.bin"):
        with contextlib.suppress(FileNotFoundError):
            total += p.stat().st_size
    return total


def page(i: int, model: str = "m", pool: str | None = None) -> str:
    """An SGLang page file name for key number i."""
    return f"{i:064x}" + (f".{pool}" if pool else "") + f"_{model}_0_1.bin"


def temp(i: int) -> str:
    return f".{i:032x}.tmp"


def big_disk(_: Path) -> tuple[int, int, int]:
    """A filesystem with room to spare, so only caps decide."""
    return (10**15, 0, 10**15)


@dataclass(frozen=True)
class Entries:
    """A flat dir's entry limit a test sets, whatever the names' length (GcPolicy.dir_entries
    as a small filesystem's DirIndex would give it)."""

    entries: int

    def limit(self, name_len: int = 0) -> int:
        return self.entries


def policy(**kw: object) -> GcPolicy:
    """A policy with only what the test asks for: no age rule, no retention, no pacing."""
    base: dict[str, object] = dict(
        min_age=0.0,
        keep_unbound=1000,
        unbound_ttl=None,
        min_free_percent=0.0,
        delete_rate=None,
    )
    base.update(kw)
    return GcPolicy(**base)  # type: ignore[arg-type]


@dataclass
class Tree:
    """A root, its index and the daemon's event writer fed as its watcher would."""

    layout: Layout
    store: Store
    rec: PageEvents = field(init=False)

    def __post_init__(self) -> None:
        self.rec = PageEvents(self.layout, self.store)

    def close(self) -> None:
        """Let go of the index and the model's key file."""
        self.rec.model.close(0)
        self.store.close()

    @classmethod
    def at(cls, root: Path) -> Tree:
        layout = Layout.at(root)
        create_root(layout)
        return cls(layout, Store.open(layout.db_path))

    def dir(self, ns: str) -> Path:
        d = self.layout.ns_dir(ns)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def write(self, ns: str, names: Iterable[str], *, at: float, size: int = 1000) -> None:
        """SGLang wrote these pages at `at`, in this order (the watcher saw it)."""
        names = list(names)
        for name in names:
            path = self.dir(ns) / name
            path.write_bytes(b"\0" * size)
            os.utime(path, (at, at))
        self.stored(ns, names, at=at)

    def stored(self, ns: str, names: Iterable[str], *, at: float) -> None:
        """The watcher saw these page files (already on disk) stored at `at`, in this order."""
        self.rec.apply([(Kind.WRITE, ns, n, at, LOCAL) for n in names], now=at)

    def read(self, ns: str, names: Iterable[str], *, at: float) -> None:
        self.rec.apply([(Kind.READ, ns, n, at, LOCAL) for n in names], now=at)

    def files(self, ns: str) -> set[str]:
        return set(os.listdir(self.layout.ns_dir(ns)))

    def add_namespace(self, ns: str, *, active: float, bound: bool = False) -> None:
        with self.store.transaction() as conn:
            conn.execute(
                "INSERT INTO namespaces (id, digest, identity_json, created_at, last_active_at)"
                " VALUES (?, ?, '{}', ?, ?)",
                (ns, ns * 2, active, active),
            )
            if bound:
                conn.execute(
                    "INSERT INTO bindings (instance, namespace_id, bound_at) VALUES (?, ?, ?)",
                    (f"server-{ns}", ns, active),
                )

    def plan(
        self,
        pol: GcPolicy,
        *,
        now: float,
        model: ChainModel | None = None,
        busy: Collection[PageId] = (),
        **kw: object,
    ) -> GcPlan:
        kw.setdefault("disk_usage", big_disk)
        live = Live(model=model, in_flight=busy)
        return plan_gc(self.layout, self.store, pol, now=now, live=live, **kw)  # type: ignore[arg-type]

    def execute(
        self, plan: GcPlan, *, now: float, dry_run: bool = False, recorded: Recorded | None = None
    ) -> GcReport:
        return execute_gc(plan, self.run(dry_run=dry_run, clock=lambda: now), recorded=recorded)

    def run(self, **kw: Any) -> RunContext:
        """A run's context on this tree (execute_gc's)."""
        return RunContext(self.layout, self.store, **kw)


def evicted(plan: GcPlan, reason: str | None = None) -> list[str]:
    """The planned names, in plan order."""
    return [n for s in plan.steps if reason in (None, s.reason) for n in s.names]
