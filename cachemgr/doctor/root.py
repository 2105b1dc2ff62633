"""Lint a cache root: damaged namespaces, trash and temps left behind, a full filesystem."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from cachemgr.doctor.finding import Finding, command_line
from cachemgr.doctor.links import lint_hard_links
from cachemgr.errors import CachemgrError
from cachemgr.fs import reserve
from cachemgr.fs.usage import DiskUsage, DiskUsageFn, atime_off, inode_usage
from cachemgr.gc.find import own_temps
from cachemgr.gc.keyfile import KEY_BYTES
from cachemgr.gc.policy import GcPolicy, Inodes
from cachemgr.layout import Layout
from cachemgr.ns.bindings import read_bindings
from cachemgr.ns.manifest import format_of
from cachemgr.ns.purge import describe_trash
from cachemgr.ns.purge_intent import trash_counts
from cachemgr.ns.quarantine import ns_root_problem
from cachemgr.ns.registry import list_namespaces, on_disk
from cachemgr.state.dbfile import corrupt_copies
from cachemgr.state.store import Store
from cachemgr.units import human_bytes


def lint_root(layout: Layout, store: Store | None) -> list[Finding]:
    """Damage under the root: namespaces in a bad state, trash an earlier run left, binding
    files that cannot be read. Without a store (the state DB cannot be read) the namespaces'
    states are not checked, the rest is."""
    if ns_root_problem(layout) is not None:  # nothing under ns/ can be read: that is said
        return _unusable(layout) + _corrupt_db_copies(layout)
    found = []
    hands_off = "inspect it by hand; cachemgr will not touch it"
    # Their states only: doctor reports no counts, and a scan lists millions of names.
    for ns in list_namespaces(layout, store, counted=False) if store is not None else []:
        if ns.state in ("unsafe", "bad-manifest"):
            found.append(
                Finding("error", f"ns-{ns.state}", f"ns {ns.ns_id}: {ns.problem}", hands_off)
            )
        elif ns.state == "missing-dir" and ns.instances:
            # A server bound here writes into a dir that is gone: its stores fail, unseen.
            what = (
                f"ns {ns.ns_id} is bound to {', '.join(ns.instances)} but its dir "
                f"{layout.ns_dir(ns.ns_id)} is missing: the server can store no page"
            )
            fix = f"run init for {ns.instances[0]} again (it makes the dir), then restart it"
            found.append(Finding("error", "ns-missing-dir", what, fix))
        elif ns.state == "no-manifest":
            what = f"{layout.ns_dir(ns.ns_id)} has no manifest: nobody knows who wrote its pages"
            fix = f"`{command_line(layout, 'purge', '--namespace', ns.ns_id, '--yes')}`"
            found.append(Finding("warning", "ns-no-manifest", what, fix))
    for entry in describe_trash(layout, trash_counts(layout, store.conn) if store else None):
        if entry.problem:
            what = f".trash/{entry.name}: {entry.problem}"
            found.append(Finding("error", "trash-unsafe", what, hands_off))
        elif entry.left_for_a_person:
            # purge and GC leave foreign files (and so the entry): a person must look.
            what = f".trash/{entry.name}: {entry.left_for_a_person}"
            fix = (
                f"inspect {entry.example} (and the rest of {layout.trash / entry.name}), remove "
                f"what is not SGLang's by hand; then {_gc(layout)} "
                "deletes the pages and the entry"
            )
            found.append(Finding("warning", "trash-foreign", what, fix))
        else:
            what = f".trash/{entry.name} still holds {entry.pages:,} pages of an unfinished purge"
            # (GC drains trash first; `purge --unbound` would purge every unbound namespace)
            fix = f"{_gc(layout)} deletes it (or let the daemon finish it)"
            found.append(Finding("warning", "trash-left", what, fix))
    for problem in read_bindings(layout)[1]:  # those the DB knows were rewritten on open
        fix = "run init for that instance again (it rewrites the file), or move it away"
        found.append(Finding("warning", "binding-unreadable", problem, fix))
    found += _unusable(layout) + _own_temps(layout) + _corrupt_db_copies(layout)
    return found + lint_hard_links(layout) + _no_atime(layout)


def _no_atime(layout: Layout) -> list[Finding]:
    """A root mounted noatime holding a nested namespace (vLLM's hashed dirs): a block read in
    a dir the daemon does not watch yet leaves no trace (cachemgr.daemon.nestwatch)."""
    try:
        if not atime_off(layout.ns_root):  # (the pages' mount, as the watcher checks it)
            return []
        names = on_disk(layout)[0]
    except (OSError, CachemgrError):
        return []  # an unlistable root is said by _unusable
    nested = sorted(ns for ns in names if format_of(layout, ns).nesting is not None)
    if not nested:
        return []
    what = (
        f"{layout.root} is mounted noatime: reads of blocks in a hashed dir made before the "
        "daemon watched it are never counted (cachemgr_watch_gap_stores_total bounds them), so "
        f"GC may evict a block just read as an old one (ns {', '.join(nested)})"
    )
    fix = "mount the root's filesystem relatime (the default) or strictatime"
    return [Finding("warning", "root-noatime", what, fix)]


def _unusable(layout: Layout) -> list[Finding]:
    """Namespace dirs this user may not list or delete in (another user made them): the
    daemon skips them (cachemgr.ns.quarantine), so their caps are not kept."""
    who = f"this user (uid {os.geteuid()})"
    fix = (
        "give the dir to the daemon's user or group (chown/chmod g+rwx), or remove it by hand "
        "as its owner"
    )
    # Gone, a symlink or a file is as unusable as an unreadable dir: the daemon holds the
    # root aside for each (cachemgr.ns.quarantine.ns_root_problem).
    problem = ns_root_problem(layout)
    names: list[str] = []
    if problem is None:
        try:
            names = sorted(
                e.name for e in os.scandir(layout.ns_root) if e.is_dir(follow_symlinks=False)
            )
        except OSError as e:  # (made unreadable since)
            problem = f"{layout.ns_root}: {e.strerror}"
    if problem is not None:
        what = f"the root cannot be used by {who}: {problem}; nothing is indexed or GCed"
        return [Finding("error", "root-unusable", what, _root_fix(layout) or fix)]
    found = []
    for name in names:
        path = layout.ns_root / name
        # Each reason said (as the daemon holds each): one may be fixed and not the other.
        why = [
            said
            for mode, said in (
                (os.R_OK | os.X_OK, "cannot be read (the index skips it)"),
                (os.W_OK | os.X_OK, "cannot be written (GC cannot delete its pages)"),
            )
            if not os.access(path, mode)
        ]
        if why:
            what = f"ns {name}: {path} {' and '.join(why)} by {who}"
            found.append(Finding("error", "ns-unusable", what, fix))
    return found + _unreadable_manifests(layout, who)


def _root_fix(layout: Layout) -> str | None:
    """How to fix an ns/ that is not a dir (None: it is one, its mode is the problem)."""
    path = layout.ns_root
    if os.path.islink(path):
        return (
            f"put the namespaces' dir itself at {path}: a symlink is never followed (mount the "
            "other filesystem there, or give --root the dir it leads to)"
        )
    if not os.path.lexists(path) or not os.path.isdir(path):
        return (
            f"move back the dir that was at {path}, or move what is there away and make an "
            f"empty one as the daemon's user (`mkdir {path}`)"
        )
    return None


def _unreadable_manifests(layout: Layout, who: str) -> list[Finding]:
    """Manifests this user may not read: their namespaces are left alone, as a bad manifest's."""
    fix = "give the file to the daemon's user or group (chown/chmod g+r), or fix its mode"
    found = []
    for ns_id in sorted(on_disk(layout)[1]):
        path = layout.manifest(ns_id)
        if not os.access(path, os.R_OK, follow_symlinks=False):
            what = f"ns {ns_id}: {path} cannot be read by {who}; the namespace is left alone"
            found.append(Finding("error", "ns-unusable", what, fix))
    return found


def _own_temps(layout: Layout) -> list[Finding]:
    """Temp files of cachemgr's own atomic writes that a kill -9 left (GC removes them)."""
    what = "{} is a temp file a killed cachemgr write left ({} bytes)"
    fix = f"{_gc(layout)} removes it once older than gc_tmp_ttl, or remove it"
    paths = [(layout.root / t.rel_dir / t.name, t.size) for t in own_temps(layout)]
    return [Finding("warning", "own-temp-left", what.format(*p), fix) for p in paths]


DiskState = Literal["ok", "low", "full"]


def disk_state(disk: DiskUsage, policy: GcPolicy) -> tuple[DiskState, int]:
    """Full: less free than GC's floor (or than the state DB needs to open); low: under 1.5
    times that. With the limit in bytes."""
    limit = max(policy.floor(disk), reserve.reserve_size(disk.total))
    state: DiskState = "full" if disk.free < limit else "low" if disk.free < limit * 1.5 else "ok"
    return state, limit


def lint_disk(
    layout: Layout,
    policy: GcPolicy,
    usage: DiskUsageFn = shutil.disk_usage,
    inodes: InodeUsageFn = inode_usage,
) -> list[Finding]:
    """A full root filesystem is an error, a nearly full one a warning (see disk_state); the
    same for its inodes under gc_min_free_inodes_percent (see inode_state)."""
    disk = DiskUsage(*usage(layout.root))
    state, limit = disk_state(disk, policy)
    what = f"{filesystem_line(disk)}; GC keeps {human_bytes(limit)} free"
    fix = f"{_gc(layout)} frees it down to the floor (the daemon does by itself); or add space"
    found = []
    if state == "full":
        found.append(Finding("error", "disk-full", f"the root's filesystem is full: {what}", fix))
    elif state == "low":
        found.append(Finding("warning", "disk-low", f"the root's filesystem is low: {what}", fix))
    return found + _lint_inodes(layout, policy, inodes)


def lint_state_disk(layout: Layout, usage: DiskUsageFn = shutil.disk_usage) -> list[Finding]:
    """A state dir on a full filesystem of its own (on the root's, lint_disk says it): the
    daemon's index, GC records and purges wait for room that GC cannot make there. Full: less
    free than the space reserve the DB keeps to open and write (reserve.reserve_size)."""
    try:
        if reserve.shares_root_fs(layout.state_dir, layout.root):
            return []
        disk = DiskUsage(*usage(layout.state_dir))
    except OSError:  # no state dir yet, or one this user may not use (state-unreadable says)
        return []
    if disk.free >= reserve.reserve_size(disk.total):
        return []
    what = (
        f"the state dir's filesystem is full: {filesystem_line(disk)}; the daemon's index, GC "
        "and purge wait for room to write the state DB"
    )
    fix = (
        f"free space on the filesystem of {layout.state_dir}, or move the state dir "
        "(--state-dir); GC frees space on the root's filesystem only"
    )
    return [Finding("error", "state-db-full", what, fix)]


InodeUsageFn = Callable[[Path], tuple[int, int]]  # (total, free) inodes: usage.inode_usage


def inode_state(total: int, free: int, policy: GcPolicy) -> tuple[DiskState, int]:
    """As disk_state, in inodes: full under GC's inode floor, low under 1.5 times it. A
    filesystem that reports no inode count (btrfs: made as needed) has no floor to hold."""
    floor = policy.inode_floor(Inodes(total, free)) if total > 0 else 0
    state: DiskState = "full" if free < floor else "low" if free < floor * 1.5 else "ok"
    return state, floor


def _lint_inodes(layout: Layout, policy: GcPolicy, inodes: InodeUsageFn) -> list[Finding]:
    """The inode floor beside the bytes': `cachemgr gc` refuses the run it cannot hold it in
    and sends the user here, where only bytes were checked ("no problems found")."""
    total, free = inodes(layout.root)
    state, floor = inode_state(total, free, policy)
    if state == "ok":
        return []
    pct = 100 * free / total if total else 0.0
    what = (
        f"{free:,} inodes free of {total:,} ({pct:.1f}%); GC keeps {floor:,} free "
        f"(gc_min_free_inodes_percent {policy.min_free_inodes_percent:g})"
    )
    if state == "full":
        what = f"the root's filesystem is out of inodes: {what}"
        return [Finding("error", "inodes-full", what, _inodes_fix(layout))]
    what = f"the root's filesystem is low on inodes: {what}"
    return [Finding("warning", "inodes-low", what, _inodes_fix(layout))]


def _inodes_fix(layout: Layout) -> str:
    # Each page is an inode: GC frees them down to the floor, but files it does not manage
    # count.
    return (
        f"{_gc(layout)} frees page files down to the floor (the daemon does "
        "by itself); if files outside the cache hold the inodes (`du -x --inodes` on the "
        "filesystem), remove those, give the cache its own filesystem, or lower "
        "gc_min_free_inodes_percent"
    )


def _gc(layout: Layout) -> str:
    """The GC run a fix gives, quoted as the fixes quote commands."""
    return f"`{command_line(layout, 'gc', '--yes')}`"


def lint_gc_unmet(unmet: Sequence[Mapping[str, Any]]) -> list[Finding]:
    """The limits the serving daemon's last GC run could not hold (its /v1/status
    `gc_unmet`): GC deleted all it may and the cache, or the disk, is still over them."""
    out = []
    for u in unmet:
        floor = u.get("limit") in ("free_space", "free_inodes")
        fix = _FLOOR_FIX if floor else _CAP_FIX
        out.append(Finding("error", "gc-limit-not-held", str(u.get("message")), fix))
    return out


def lint_watches(index: Mapping[str, Any] | None) -> list[Finding]:
    """The serving daemon's dirs the kernel refused an inotify watch (its /v1/status `index`),
    not watched since: in namespaces, or <root>/ns itself."""
    short = index.get("watch_refused_namespaces") if index else None
    root = bool(index.get("watch_root_refused")) if index else False
    if not index or not (short or root):
        return []
    where = [f"{short} namespace(s) have dirs without an inotify watch"] if short else []
    where += ["<root>/ns has no inotify watch, so new namespaces are found late"] if root else []
    what = (
        f"{'; '.join(where)}: the kernel refused {index.get('watches_refused')} watches "
        "(fs.inotify.max_user_watches reached). What happens there is seen by the reconcile "
        "scans only; GC's order and the hit counts miss it"
    )
    return [Finding("error", "inotify-watch-limit", what, _WATCHES_FIX)]


_WATCHES_FIX = (
    "raise the limit on the host: `sysctl -w fs.inotify.max_user_watches=1048576` and the same "
    "line in /etc/sysctl.d/ (it is per user on the node, not per container); a vLLM cache needs "
    "one watch per dir of its tree (docs/daemon.md)"
)


def lint_keys_in_memory(served: Mapping[str, Any] | None, layout: Layout) -> list[Finding]:
    """The serving daemon's page keys held in its memory (its /v1/status
    `gc_model_keys_in_memory`): their file in the state dir cannot be written."""
    kept = served.get("gc_model_keys_in_memory") if served else None
    if not kept:
        return []
    held = human_bytes(kept * (KEY_BYTES + 1))  # (and a byte a slot saying it is held)
    what = (
        f"GC's model holds {kept:,} page keys in the daemon's memory (~{held}), not in their "
        f"file in the state dir {layout.state_dir}: it cannot be written (its filesystem full "
        "or read-only); they stay in memory until it can be"
    )
    fix = (
        f"free space on {layout.state_dir}'s filesystem (`df {layout.state_dir}`) or make it "
        "writable (its mount, its mode); the daemon moves the keys back to the file as it "
        "writes keys again, no restart needed"
    )
    return [Finding("warning", "model-keys-in-memory", what, fix)]


# Files GC does not manage fill the filesystem: emptying the cache would not be enough.
_FLOOR_FIX = (
    "free space outside the cache (`du -x` on the filesystem), give the cache its own "
    "filesystem, or lower gc_min_free_percent / gc_min_free_bytes / gc_min_free_inodes_percent"
)
_CAP_FIX = (
    "what is left is not GC's to delete: see the other findings and `cachemgr gc --dry-run`'s "
    "warnings (a quarantined or damaged namespace, files that are not pages), or raise the cap"
)


def filesystem_line(disk: DiskUsage) -> str:
    """`3.6 MB free of 57.4 MB (6.3%)`: how full a filesystem is, for people."""
    pct = 100 * disk.free / disk.total if disk.total else 0.0
    return f"{human_bytes(disk.free)} free of {human_bytes(disk.total)} ({pct:.1f}%)"


def _corrupt_db_copies(layout: Layout) -> list[Finding]:
    """State DBs found corrupt and moved aside (store.py) take disk space until someone looks."""
    copies = corrupt_copies(layout.db_path)
    what = "{} is a state DB found corrupt and moved aside; the index was rebuilt from disk"
    fix = "keep it for a bug report, or remove {} (and its -wal/-shm)"
    return [Finding("warning", "state-db-corrupt", what.format(p), fix.format(p)) for p in copies]
