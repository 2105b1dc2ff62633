"""Garbage collection as a plan, then its execution (huggingface_hub's cache manager style).

`plan_gc` reads the index and the disk and decides, in order: leftovers in .trash/; stale
.tmp files; unbound namespaces past retention (oldest first); torn pages; then pages of live
namespaces in the order over learned chains (cachemgr.gc.value: tails before heads, least
valuable chains first) until each namespace cap and the root's budget (byte cap or free-space
floor) are back under the low watermark. The daemon plans from its live chain model; a one-off
run builds one from the index. The plan lists the steps in the order they run: those that hold
a limit first, then the rest (a purge's drain of millions of files, paced, held every cap and
the floor back while it went first). `execute_gc` deletes exactly the planned files through
cachemgr.fs.deletion, so a dry run reports what a real run frees.
"""

from __future__ import annotations

import math
import os
import shutil
import sqlite3
import stat
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

from cachemgr.errors import UnsafePathError
from cachemgr.formats import format_for
from cachemgr.fs.deletecheck import too_young
from cachemgr.fs.dirlimit import page_name_len
from cachemgr.fs.usage import DiskUsage, DiskUsageFn, inode_usage
from cachemgr.gc import find as gcfind
from cachemgr.gc.chains import CYCLE_WALK, ChainModel
from cachemgr.gc.find import list_namespace, list_temps
from cachemgr.gc.pagestore import NONE, PageId
from cachemgr.gc.policy import (
    FILE_LIMITS,
    HOLDING,
    ByReason,
    Files,
    GcPolicy,
    GcReason,
    Inodes,
    files_over,
    over_file_limits,
    over_limits,
    room,
    tally,
)
from cachemgr.gc.sightings import TempSightings
from cachemgr.gc.step import GcStep, Unmet
from cachemgr.gc.value import cap_order
from cachemgr.layout import Layout
from cachemgr.ns.manifest import identity_model, identity_record
from cachemgr.ns.purge_intent import trash_counts
from cachemgr.state import pages_sql, registry_sql
from cachemgr.state.index import namespace_dirs
from cachemgr.state.store import Store, read_snapshot


@dataclass(frozen=True)
class GcPlan(ByReason):
    """What a GC run will delete, and the numbers that decided it."""

    created_at: float
    steps: tuple[GcStep, ...]
    used_bytes: int  # page bytes of all namespaces in the index
    budget_bytes: int | None  # the root's limit; None when nothing limits it
    budget_reason: GcReason
    warnings: tuple[str, ...] = ()
    overridden: int = 0  # pages a protection (min_age, in flight) held that a limit took
    unmet: tuple[Unmet, ...] = ()  # limits it leaves over their high watermark

    def totals(self) -> dict[GcReason, tuple[int, int]]:
        """(files, bytes) per reason, in plan order."""
        return tally((s.reason, s.files, s.bytes) for s in self.steps)


@dataclass(frozen=True)
class Earlier:
    """What an earlier pass of the same run deletes first (the floor pass's, planned in a dry
    run): the plan counts its files as gone and their bytes as free, as the real run finds the
    disk after that pass (by file sizes, not the blocks they held)."""

    files: frozenset[tuple[str, str]] = frozenset()  # (rel_dir, name)
    dirs: frozenset[str] = frozenset()  # the dirs it removes whole (trash entries)
    by_namespace: tuple[tuple[str, int], ...] = ()  # page bytes of each namespace's steps
    unlisted: int = 0  # files of its steps counted, not named (trash entries): inodes freed

    @classmethod
    def of(cls, steps: Sequence[GcStep]) -> Earlier:
        """The files these steps delete."""
        by_ns: dict[str, int] = {}
        for s in steps:
            if s.namespace_id is not None and s.rel_dir.startswith("ns/"):
                by_ns[s.namespace_id] = by_ns.get(s.namespace_id, 0) + s.bytes
        return cls(
            frozenset((s.rel_dir, n) for s in steps for n in s.names),
            frozenset(s.rel_dir for s in steps if s.remove_dir),
            tuple(sorted(by_ns.items())),
            sum(s.count for s in steps if s.count is not None),
        )

    def freed(self, disk: DiskUsage, trash: int) -> DiskUsage:
        """`disk` once these files (and `trash` bytes of trash entries) are gone."""
        gone = sum(b for _, b in self.by_namespace) + trash
        return disk._replace(used=disk.used - gone, free=disk.free + gone)

    def without(self, step: GcStep, sizes: dict[str, int]) -> GcStep:
        """`step` less the files deleted before it (`sizes`: its files' bytes)."""
        names = tuple(n for n in step.names if (step.rel_dir, n) not in self.files)
        return replace(step, names=names, bytes=sum(sizes.get(n, 0) for n in names))


@dataclass(frozen=True)
class Live:
    """What the running daemon knows beyond the index when GC plans; a one-off run knows
    none of it (and builds a chain model from the index if pages must go)."""

    model: ChainModel | None = None  # the index's live chain model
    pending: int = 0  # bytes stored that the index does not count yet
    ahead: int = 0  # bytes the writer adds before the run is done (policy.over_limits)
    # Pages requests use that the model has not seen yet: they and their ancestors stay.
    in_flight: Collection[PageId] = ()
    # Page files stored that the index has not applied yet, as (namespace, name) in the order
    # a cap takes them (cachemgr.daemon.backlog.take_order): at full speed the index lags the
    # writer by seconds (many times a small cap), so a cap takes them too once no page it
    # knows of is left (_unapplied).
    unapplied: Sequence[PageId] = ()
    # The size the writer's stores are counted at, as `pending` counts them (0: unknown yet):
    # a cap takes unapplied stores by it, without a stat each (_unapplied).
    store_bytes: int = 0
    # The trash entries' counts as the runs know them (None: a scan of each at every plan).
    trash: gcfind.TrashCounts | None = None
    # The temps the leader has seen, by its own clock (fleet mode; None: by their mtime alone).
    temps: TempSightings | None = None


def plan_gc(
    layout: Layout,
    store: Store,
    policy: GcPolicy,
    *,
    now: float,
    disk_usage: DiskUsageFn = shutil.disk_usage,
    sweep: bool = True,
    live: Live = Live(),
    after: Earlier = Earlier(),
) -> GcPlan:
    """Decide what to delete. `sweep` also lists namespace dirs for temps and checks page
    sizes; without it only the index is read. `after`: what a pass made before this plan
    deletes (a dry run's floor pass)."""
    with read_snapshot(store.conn) as conn:
        return _plan(conn, layout, policy, now, disk_usage, sweep, live, after)


def _plan(
    conn: sqlite3.Connection,
    layout: Layout,
    policy: GcPolicy,
    now: float,
    disk_usage: DiskUsageFn,
    sweep: bool,
    daemon: Live,
    after: Earlier,
) -> GcPlan:
    usage = pages_sql.namespace_bytes(conn)
    for ns_id, gone_bytes in after.by_namespace:
        if ns_id in usage:
            usage[ns_id] -= gone_bytes
    # A dir that became a symlink (or worse) is skipped with a warning, never a failed run:
    # GC must go on bounding everything else.
    warnings: list[str] = []
    trash = gcfind.trash_leftovers(layout, warnings, daemon.trash, trash_counts(layout, conn))
    steps = [s for s in trash if s.rel_dir not in after.dirs]
    freed_trash = sum(s.bytes for s in trash if s.rel_dir in after.dirs)
    # Damaged namespaces (a bad manifest, a symlink in place of the dir) are left alone
    # whole: not dropped as unbound, no page of theirs evicted.
    alone = gcfind.left_alone(layout, warnings)
    gone = set(alone)  # and dropped: no page evicted one by one
    drops: list[GcStep] = []
    for ns_id, reason in gcfind.unbound_past_retention(conn, policy, now):
        if ns_id in gone:
            continue
        gone.add(ns_id)
        try:
            pages, ns_temps = list_namespace(layout, ns_id)
        except UnsafePathError as e:
            warnings.append(f"ns/{ns_id} not dropped: {e}")
            continue
        young = sum(too_young(f.mtime, policy.min_age, now) for f in pages.values()) + sum(
            too_young(t.mtime, policy.min_age, now) for t in ns_temps
        )
        if young:  # the whole namespace waits: a drop never leaves part of one behind
            gone.discard(ns_id)
            warnings.append(f"ns/{ns_id} not dropped yet: {young} files younger than min_age")
            continue
        names = tuple(sorted([*pages, *(t.name for t in ns_temps)]))
        sizes = {n: f.size for n, f in pages.items()} | {t.name: t.size for t in ns_temps}
        drop = GcStep(reason, f"ns/{ns_id}", ns_id, names, 0, policy.min_age, True)
        drops.append(after.without(drop, sizes))
    if sweep:
        temps = [t for ns in namespace_dirs(layout) for t in list_temps(layout, ns, warnings)]
        own = gcfind.own_temps(layout)
        if daemon.temps is not None:  # a fleet's leader: by its own clock too
            temps, own = daemon.temps.settled(temps, own, policy.tmp_ttl)
        steps += gcfind.stale_temps([t for t in temps if t.namespace_id not in gone], policy, now)
        steps += gcfind.stale_own_temps(own, policy, now)
    steps += drops
    unlisted = sum(s.bytes for s in steps if s.reason in ("trash", "tmp"))
    # No age rule at all without min_age: an access time in the future (a clock stepped back,
    # a previous leader's clock ahead) must not make a page unevictable (cf. too_young).
    before = now - policy.min_age if policy.min_age > 0 else math.inf
    if sweep:
        torn, mixed = gcfind.torn_pages(conn, gone, policy, now)
        steps += [after.without(s, _sizes(conn, s)) for s in torn] if after.files else torn
        warnings += mixed
    taken = {(s.namespace_id, n) for s in steps if s.reason == "corrupt" for n in s.names}
    taken |= {(rel.removeprefix("ns/"), n) for rel, n in after.files if rel.startswith("ns/")}
    live = {ns: b for ns, b in usage.items() if ns not in gone}
    for s in steps:
        if s.reason == "corrupt" and s.namespace_id is not None:
            live[s.namespace_id] -= s.bytes
    used_all = sum(usage.values())
    counted = used_all + unlisted
    disk = after.freed(DiskUsage(*disk_usage(layout.root)), freed_trash)
    ahead = daemon.ahead
    pending = daemon.pending
    busy = daemon.in_flight
    # What is left alone stays: on the disk and under the root's limits, as the cheap check
    # counts it (cachemgr.gc.check), but the other pages must make room for it.
    kept = sum(usage.get(ns, 0) for ns in alone)
    limits = over_limits(
        policy, live, disk, counted=counted, ahead=ahead, pending=pending, kept=kept
    )
    files = file_counts(conn, layout, live, after, alone, gone)
    files = files.with_writer(ahead + pending, usage)
    chains = daemon.model
    if chains is None:  # a one-off run reads the page rows only if pages must go
        over = bool(limits.namespaces) or limits.root is not None
        over = over or files_over(policy, files)
        # (its keys beside the DB, as the daemon's: not in $TMPDIR, a container's small /tmp)
        chains = ChainModel.from_index(conn, sorted(live) if over else [], layout.state_dir)
    overridden = 0
    unmet: list[Unmet] = []
    for ns_id, need in limits.namespaces.items():
        victims, forced = _pick(chains, [ns_id], (need, need), before, taken, now, busy)
        live[ns_id] -= sum(p.bytes for p in victims.values())
        spare = _share(room(policy, policy.namespace_max_bytes or 0), need)
        steps += _evictions("cap", victims, policy.min_age, spare)
        overridden += forced
        unmet += _ns_cap_unmet(policy, ns_id, live[ns_id])
    for ns_id in sorted(alone):  # over its own cap with no page GC may evict
        unmet += _ns_cap_unmet(policy, ns_id, usage.get(ns_id, 0))
    # What the caps evict counts toward the root's budget: ask again with what is left.
    budget = limits.budget
    excess = over_limits(
        policy, live, disk, counted=counted, ahead=ahead, pending=pending, kept=kept
    ).root
    if excess is not None:
        # Protections yield only for what the index counts: pages stored that it has not
        # applied yet (and the writer's pace) are not in the chain model, whose order would
        # not know what they continue (the prefix a queued store hangs on would go first).
        indexed = budget.excess(sum(live.values()) + kept, policy.low_watermark)
        # The pages no protection holds, then the stores the index has not applied, then what
        # a protection holds: the stores continue the chains in flight (a stream's last
        # indexed page is the head they hang on), so they go before those heads.
        victims, _ = _pick(chains, list(live), (excess, 0), before, taken, now, busy)
        spare = _share(room(policy, budget.limit, ahead), excess)
        steps += _evictions(budget.reason, victims, policy.min_age, spare)
        freed = sum(p.bytes for p in victims.values())
        short = excess - freed
        if short > 0 and daemon.unapplied:
            early = _unapplied(layout, daemon, short, steps, budget.reason)
            steps += early
            short -= sum(s.bytes for s in early)
            overridden += sum(len(s.names) for s in early)
        if short > 0:
            held = (short, indexed - freed)
            victims, forced = _pick(chains, list(live), held, before, taken, now, busy)
            steps += _evictions(budget.reason, victims, policy.min_age)
            overridden += forced
            short -= sum(p.bytes for p in victims.values())
        if short > 0:
            warnings.append(
                f"{budget.reason}: {short} bytes still over the low watermark; "
                "no other page is indexed"
            )
        # Over by the writer's predicted bytes alone is no limit missed: only what is on disk
        # counts (live, kept and pending bytes, as over_limits counts them). A floor the
        # filesystem does not meet even with no cache is missed however much of it goes.
        left = sum(live.values()) + kept + pending - (excess - short)
        if budget.over(left, policy.high_watermark):
            gap = budget.shortfall(left, policy.low_watermark)
            unmet.append(Unmet(budget.reason, None, "bytes", gap))

    def pick_files(ids: list[str], need: tuple[int, int]) -> tuple[dict[_Victims, _Picked], int]:
        return _pick(chains, ids, need, before, taken, now, busy, True)

    forced, short_files = _file_evictions(policy, files, steps, pick_files)
    overridden += forced
    warnings += short_files
    unmet += _files_unmet(policy, files, steps)
    warnings += [u.line() for u in unmet]
    if overridden:
        warnings.append(
            f"{overridden} pages younger than min_age ({policy.min_age:g}s) or in flight "
            "evicted: a limit wins over their protection"
        )
    limit = None if budget.limit == float("inf") else int(budget.limit)
    return GcPlan(
        now,
        tuple(sorted(steps, key=lambda s: s.reason not in HOLDING)),  # (a stable sort)
        used_all,
        limit,
        budget.reason,
        tuple(warnings),
        overridden,
        tuple(unmet),
    )


def _ns_cap_unmet(policy: GcPolicy, ns_id: str, used: int) -> list[Unmet]:
    """The namespace's byte cap, if `used` (what the plan leaves of it) is over its high
    watermark."""
    cap = policy.namespace_max_bytes
    if cap is None or used <= cap * policy.high_watermark:
        return []
    return [Unmet("cap", ns_id, "bytes", used - int(cap * policy.low_watermark))]


def file_counts(
    conn: sqlite3.Connection,
    layout: Layout,
    live: Collection[str],
    after: Earlier,
    alone: Collection[str] = (),
    gone: Collection[str] = (),
) -> Files:
    """Page files of each live namespace by the index (less those `after` deletes), and of
    each one left `alone`, which namespaces keep them in one dir, and the root filesystem's
    inodes (plus those `after` frees): what the file limits are kept on. A namespace dir with
    no page left but other files counts as live with 0 pages, unless `gone` (dropped whole)."""
    indexed = pages_sql.namespace_file_counts(conn)
    counts = {ns: n for ns, n in indexed.items() if ns in live}
    # Its other files still fill its dir's index once GC took every page: that entry limit
    # stays crossed (unmet, nothing left to evict), as doctor and the ratio metric say it,
    # not out of GC's view because the index counts no page (its gauge went back to 0).
    bare = set(pages_sql.namespace_other_files(conn)) - {*indexed, *alone, *gone}
    if bare:
        counts |= {ns: 0 for ns in namespace_dirs(layout) if ns in bare}
    kept = {ns: n for ns, n in indexed.items() if ns in alone}
    for rel, _ in after.files:
        ns = rel.removeprefix("ns/")
        if rel.startswith("ns/") and ns in counts:
            counts[ns] -= 1
    inodes = Inodes(*inode_usage(layout.root))
    freed = inodes._replace(free=inodes.free + len(after.files) + after.unlisted)
    flat = flat_names(conn, [*counts, *kept])
    others = {ns: n for ns, n in pages_sql.namespace_other_files(conn).items() if ns in flat}
    return Files(counts, flat, freed, kept=kept, others=others)


def flat_names(conn: sqlite3.Connection, namespaces: Collection[str]) -> dict[str, int]:
    """Of these namespaces, those whose pages sit in one dir, with the length of their page
    names: SGLang's carry the served model name its identity records, or are longer (pools,
    ranks) as the index has seen them, as doctor's and the metric's entry limit count them
    (cachemgr.ns.status.NamespaceStatus.entry_limit)."""
    out: dict[str, int] = {}
    seen = pages_sql.namespace_name_lengths(conn)
    for ns in namespaces:
        identity = identity_record(registry_sql.identity_json(conn, ns))
        if format_for(identity).nesting is None:
            out[ns] = max(page_name_len(identity_model(identity)), seen.get(ns, 0))
    return out


_Victims = tuple[str, bool]  # (namespace, taken despite a protection)
Pick = Callable[[list[str], tuple[int, int]], tuple[dict[_Victims, "_Picked"], int]]


def _file_evictions(
    policy: GcPolicy, files: Files, steps: list[GcStep], pick: Pick
) -> tuple[int, list[str]]:
    """Evictions for the file caps and the inode floor (after those for bytes, which count:
    `steps` grows with them), by `pick` in files; how many a protection held, and warnings."""
    gone = _gone_files(files, steps)
    forced = 0
    by_ns, _, _ = over_file_limits(policy, _less(files, gone))
    for ns_id, (need, reason) in by_ns.items():
        victims, held = pick([ns_id], (need, need))
        gone[ns_id] += sum(len(p.names) for p in victims.values())
        steps += _evictions(reason, victims, policy.min_age)
        forced += held
    _, budget, excess = over_file_limits(policy, _less(files, gone))
    if excess is None:
        return forced, []
    victims, held = pick(list(files.live), (excess, excess))
    steps += _evictions(budget.reason, victims, policy.min_age)
    short = excess - sum(len(p.names) for p in victims.values())
    if short > 0:
        return forced + held, [f"{budget.reason}: {short} files still over the low watermark"]
    return forced + held, []


def _gone_files(files: Files, steps: Sequence[GcStep]) -> dict[str, int]:
    """Page files of each live namespace that `steps` delete (evictions and torn pages)."""
    gone = {ns: 0 for ns in files.live}
    for s in steps:
        if s.namespace_id in gone and s.reason in HOLDING | {"corrupt"}:
            gone[s.namespace_id] += len(s.names)
    return gone


def _files_unmet(policy: GcPolicy, files: Files, steps: Sequence[GcStep]) -> list[Unmet]:
    """The file limits still over their high watermark once `steps` are done, counting the
    files on disk only (not the writer's predicted ones)."""
    left = _less(files, _gone_files(files, steps))._replace(ahead=0)
    by_ns, budget, root = over_file_limits(policy, left)
    alone, _, _ = over_file_limits(policy, Files(left.kept, left.flat, others=left.others))
    out = [Unmet(reason, ns, "files", n) for ns, (n, reason) in (by_ns | alone).items()]
    if root is not None:
        used = left.used()
        out.append(
            Unmet(budget.reason, None, "files", budget.shortfall(used, policy.low_watermark))
        )
    return out


def _less(files: Files, gone: dict[str, int]) -> Files:
    """`files` once `gone` files of each namespace are deleted (their inodes free again)."""
    live = {ns: n - gone.get(ns, 0) for ns, n in files.live.items()}
    inodes = files.inodes
    if inodes is not None:
        inodes = inodes._replace(free=inodes.free + sum(gone.values()))
    return files._replace(live=live, inodes=inodes)


def _sizes(conn: sqlite3.Connection, step: GcStep) -> dict[str, int]:
    """The indexed size of each file of a namespace's step."""
    assert step.namespace_id is not None
    return {n: size for n, size, _, _ in pages_sql.namespace_files(conn, step.namespace_id)}


@dataclass
class _Picked:
    """The pages of one namespace chosen to go: their files' names in eviction order."""

    names: list[str]
    bytes: int


def _pick(
    model: ChainModel,
    ns_ids: list[str],
    need: tuple[int, int],
    before: float,
    taken: set[tuple[str | None, str]],
    now: float,
    busy: Collection[PageId],
    by_files: bool = False,
) -> tuple[dict[tuple[str, bool], _Picked], int]:
    """Pages to evict, in order, until `need[0]` bytes, by (namespace, taken despite a
    protection) in order of first victim, and how many a protection held; `taken` (files)
    grows with the choice. A busy page stays, and so do its ancestors (they come later in the
    order, tails first), unless nothing else is left: then the limit wins, up to `need[1]`
    bytes in all (cachemgr.gc.value.cap_order). `by_files`: `need` counts files, not bytes.

    Only names are kept, not each `Victim`: a quarter of a million objects the garbage
    collector tracks would make its full collections, which hold the GIL, that much longer."""
    out: dict[tuple[str, bool], _Picked] = {}
    freed = forced = 0
    if need[0] <= 0:
        return out, 0
    kept: set[PageId] = set()
    for c, over in cap_order(model, ns_ids, before=before, now=now):
        if over and freed >= need[1]:
            break
        pid = (c.namespace_id, c.key)
        if not over and pid in busy and pid not in kept:
            kept |= lineage(model, pid, kept)
        if not over and pid in kept:
            continue
        files = {(c.namespace_id, n) for n in c.names}
        if not files.isdisjoint(taken):
            continue  # a torn file's page, or one the first pass took: in a step already
        taken |= files
        picked = out.get((c.namespace_id, over))
        if picked is None:
            picked = out[c.namespace_id, over] = _Picked([], 0)
        picked.names.extend(c.names)
        picked.bytes += c.size
        freed += len(c.names) if by_files else c.size
        forced += over
        if freed >= need[0]:
            break
    return out, forced


def _unapplied(
    layout: Layout, daemon: Live, need: int, steps: Sequence[GcStep], reason: GcReason
) -> list[GcStep]:
    """Stores the index has not applied, in the order `daemon.unapplied` gives (each request's
    burst tail first: what is left of one is a usable prefix), until `need` bytes, less the
    files the other steps take. Tails a request just wrote, which the chain model has not
    seen, with no age rule (the cap wins; those just reached are spared, as any page, before
    each chunk). Each counts `store_bytes`, as `pending` counts it: no stat here (each let
    the index thread take the GIL, most of a run at full speed); execution checks each as any
    page (the name's shape, a regular file by lstat: never a link, the dir) and says what it
    freed."""
    taken = {(s.namespace_id, n) for s in steps for n in s.names}
    by_ns: dict[str, tuple[list[str], list[int]]] = {}
    got = 0
    for ns, name in daemon.unapplied:
        if got >= need:
            break
        if (ns, name) in taken or "/" in name:  # (nested formats: their pages stay indexed)
            continue
        size = daemon.store_bytes or _file_size(layout, ns, name)
        if size is not None:
            names, sizes = by_ns.setdefault(ns, ([], []))
            names.append(name)
            sizes.append(size)
            got += size
    return [
        GcStep(reason, f"ns/{ns}", ns, tuple(names), sum(sizes), 0.0)
        for ns, (names, sizes) in by_ns.items()
    ]


def _file_size(layout: Layout, ns: str, name: str) -> int | None:
    """A regular file's size by lstat (None: gone, or not a regular file): before the index
    applied any store, the size stores are counted at is not known yet."""
    try:
        st = os.lstat(layout.ns_dir(ns) / name)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _evictions(
    reason: GcReason, victims: dict[tuple[str, bool], _Picked], min_age: float, spare: float = 0
) -> list[GcStep]:
    """One step per namespace (and one more for the pages a protection held: no age rule
    there), names in eviction order, namespaces in order of first victim. `spare`: the share
    of each step's bytes that pages spared at execution may keep (GcStep.room)."""
    steps = []
    for (ns, forced), p in victims.items():
        age, stay = (0.0, 0) if forced else (min_age, math.floor(p.bytes * spare))
        names = tuple(p.names)
        steps.append(GcStep(reason, f"ns/{ns}", ns, names, p.bytes, age, forced=forced, room=stay))
    return steps


def _share(room: int, need: int) -> float:
    """The share of a limit's evictions that may stay, `room` of the `need` bytes."""
    return min(1.0, room / need) if need > 0 else 0.0


def lineage(model: ChainModel, pid: PageId, known: Collection[PageId] = ()) -> set[PageId]:
    """The page and its known ancestors (on disk or not): what a request using it needs. The
    walk stops at a page in `known` (its ancestors are there already): pages in flight of one chain
    cost one walk up it, not one each."""
    with model.lock:
        st, out, at = model.store, {pid}, model.store.find(*pid)
        while at != NONE and len(out) < CYCLE_WALK:
            at = st.pred[at]
            if at != NONE:
                up = (pid[0], st.key(at))
                if up in known:
                    break
                out.add(up)
    return out


def unrecorded_unmet(plan: GcPlan) -> tuple[Unmet, ...]:
    """The limits a plan was to hold, unmet by what its steps were to take (or the plan's own
    word on a limit it left unmet): a run whose deletions the state DB could not record."""
    cause = "the state DB's filesystem is full: GC cannot record a deletion"
    taken: dict[tuple[GcReason, str | None], int] = {}
    for step in plan.steps:
        if step.reason not in HOLDING:
            continue
        # A root limit's steps are in each namespace it takes from: said once, as the root's.
        scope = None if step.reason == plan.budget_reason else step.namespace_id
        size = step.files if step.reason in FILE_LIMITS else step.bytes
        taken[step.reason, scope] = taken.get((step.reason, scope), 0) + size
    unmet = [
        Unmet(reason, scope, "files" if reason in FILE_LIMITS else "bytes", size, cause)
        for (reason, scope), size in taken.items()
    ]
    return (*plan.unmet, *unmet)
