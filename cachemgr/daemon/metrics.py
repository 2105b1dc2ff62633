"""Prometheus metrics from the live index, the state DB and the filesystem.

One prefix (`cachemgr_`), base units, `_total` counters, labels bounded by the number of
namespaces (never per page). What comes from the DB and the disk (the small aggregate tables
namespace_stats, namespaces, bindings; the audit rows added since the last read; manifests;
statvfs) is read into a snapshot, so it costs the same with a thousand pages or ten million.
In the daemon a refresher thread takes the snapshot (cachemgr.daemon.refresher), and a scrape
only renders it with the live counters: no SQL, no file read, nothing that waits for the GIL
behind a busy GC or index thread. Counters that must survive restarts and include CLI
actions (purges, evictions) are sums over the audit log; page reads/writes count since start.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from cachemgr import __version__, engines
from cachemgr.daemon.index_state import IndexState
from cachemgr.engine import Probe, ProbeState
from cachemgr.errors import StateCorrupt
from cachemgr.fs.dirlimit import DirIndex
from cachemgr.fs.dirlimit import dir_index as read_dir_index
from cachemgr.fs.usage import DiskUsage, disk_usage
from cachemgr.gc.policy import HOLDING
from cachemgr.gc.runner import GcRunner
from cachemgr.layout import Layout
from cachemgr.ns.quarantine import ROOT, STATE_DIR, Quarantine
from cachemgr.ns.status import NamespaceStatus, namespace_statuses
from cachemgr.state import busy
from cachemgr.state.status import AuditTotal, AuditTotals
from cachemgr.worker import Worker

Reader = Callable[[], AbstractContextManager[sqlite3.Connection]]
NS_ENGINE = ["namespace", "engine"]  # "sglang" or "vllm": which engine's cache it is

# (name, help) of every metric, for docs/daemon.md and the deploy rules; keep in sync.
METRICS: dict[str, str] = {
    "cachemgr_up": "1 while the daemon runs",
    "cachemgr_ready": "1 once the first scan finished and the index is live",
    "cachemgr_index_settled": "1 once GC may run: the index matched the disk since the start "
    "and GC's model is loaded (0 while ready: the scan after a restart, or the model's load)",
    "cachemgr_worker_up": "1 while the daemon's worker thread runs; 0 once it died of an error",
    "cachemgr_build_info": "cachemgr version",
    "cachemgr_namespace_info": "identity of each namespace and its instances",
    "cachemgr_namespace_pages": "page files in the namespace",
    "cachemgr_namespace_bytes": "bytes of page files in the namespace",
    "cachemgr_page_reads_total": "page files read (L3 hits) since the daemon started",
    "cachemgr_page_writes_total": "page files stored (L3 misses filled) since the daemon started",
    "cachemgr_namespace_temp_files": "the engine's temp files (stores in progress or crashed)",
    "cachemgr_namespace_foreign_files": "neither page nor temp files, at the last scan",
    "cachemgr_namespace_corrupt_pages": "pages of an unusual size (truncated?), at the last scan",
    "cachemgr_evicted_pages_total": "pages evicted by GC, by reason (audit log)",
    "cachemgr_evicted_bytes_total": "bytes evicted by GC, by reason (audit log)",
    "cachemgr_purges_total": "namespace purges, by reason (audit log)",
    "cachemgr_purged_pages_total": "pages dropped by purges, by reason (audit log)",
    "cachemgr_purged_bytes_total": "bytes dropped by purges, by reason (audit log)",
    "cachemgr_filesystem_avail_bytes": "bytes available on the root's filesystem",
    "cachemgr_filesystem_size_bytes": "size of the root's filesystem",
    "cachemgr_filesystem_avail_inodes": "inodes available on the root's filesystem",
    "cachemgr_namespace_dir_entries_limit_ratio": "entries of a flat namespace dir over the "
    "entries its filesystem takes in one dir before ENOSPC (ext4 without large_dir; absent "
    "where no such limit is known)",
    "cachemgr_scans_total": "namespace directory scans (initial, new dir, overflow, reconcile)",
    "cachemgr_scan_seconds_total": "time spent scanning namespace directories",
    "cachemgr_last_scan_duration_seconds": "duration of the last namespace scan",
    "cachemgr_index_drift_pages_total": "index rows a rescan had to add or remove (events missed)",
    "cachemgr_watcher_overflows_total": "inotify queue overflows (each triggers a full rescan)",
    "cachemgr_index_events_total": "watcher events applied to the index",
    "cachemgr_watch_gap_stores_total": "page files a new nested dir (vLLM's hashed dirs) held "
    "when its watch was added: stores counted from its listing, whose reads inotify missed",
    "cachemgr_watch_gap_reads_total": "reads of those files shown by their atime, counted late; "
    "stores minus reads bounds the reads lost (all of them on a root mounted noatime)",
    "cachemgr_watches_refused_total": "dirs the kernel refused an inotify watch "
    "(fs.inotify.max_user_watches reached): their reads and stores are seen by the reconcile "
    "scans only, which try the watch again",
    "cachemgr_watch_refused_namespaces": "namespaces with a dir the kernel refused a watch and "
    "not watched since (the reconcile scans retry; with reconcile_interval 0, nothing does)",
    "cachemgr_watch_root_refused": "1 while <root>/ns itself has no inotify watch, the kernel "
    "refused it: new namespace dirs are found by the reconcile scans only, which retry",
    "cachemgr_index_lag_seconds": "age of the oldest watcher event not yet applied",
    "cachemgr_identity_mismatches_total": "SGLang servers found contradicting their namespace",
    "cachemgr_identity_mismatch": "1 while the SGLang server contradicts its namespace",
    **engines.probe_metrics(),  # each engine's probe: its server's own figures
    "cachemgr_namespace_unusable": "1 while the daemon cannot use the namespace's dir (another "
    "user's: unreadable, or its pages not deletable); the index and GC skip it",
    "cachemgr_root_unusable": "1 while the daemon cannot list the root's ns/ dir; it waits for it",
    "cachemgr_state_dir_unusable": "1 while the daemon may not use its state dir (its mode, or "
    "its filesystem full): the index, GC and purge wait for the DB (the pages stay, and SGLang "
    "serves them)",
    "cachemgr_state_db_locked": "1 while a write of this daemon waits for another connection's "
    "write lock on the state DB",
    "cachemgr_state_db_lock_wait_seconds_total": "time this daemon's writes spent waiting for "
    "another connection's write lock on the state DB",
    "cachemgr_gc_leader": "1 while this daemon holds the root's GC lock (it alone deletes)",
    "cachemgr_index_leader": "1 while this daemon writes the root's index (the others follow it)",
    "cachemgr_gc_runs_total": "GC runs by result: ok, error, skipped (another process leads), "
    "short (a cap or a floor not held: files it needed gone could not be deleted, or GC had "
    "too little it may delete)",
    "cachemgr_gc_limits_unmet": "limits the last GC run left over their high watermark with "
    "nothing else it may delete, by limit (cap, free_space, files, free_inodes, dir_full): "
    "0 when it held them all",
    "cachemgr_gc_refused_files_total": "files GC meant to delete and had to keep, by reason "
    "(permission: the kernel refused, e.g. a writer's dir without the group's write)",
    "cachemgr_gc_protection_overridden_total": (
        "Pages a cap or the free-space floor evicted though min_age or in-flight protection held"
        " them (nothing else was left to evict)"
    ),
    "cachemgr_gc_last_success_timestamp_seconds": "when a GC cycle last ended without error "
    "(daemon start until the first)",
    "cachemgr_gc_audit_rows_held": "audit rows of free-space floor passes the state DB took no "
    "write of yet (written once it does)",
    "cachemgr_gc_audit_rows_dropped_total": "held audit rows dropped past the bound "
    "(cachemgr.gc.held.HELD_ROWS), each logged with its counts",
    "cachemgr_gc_model_keys_in_memory": "page keys GC's model holds in the daemon's memory "
    "(~33 bytes each) because their file in the state dir cannot be written (its filesystem "
    "full or read-only); 0 while the file takes them",
    "cachemgr_http_connections": "open HTTP connections",
    "cachemgr_http_connections_max": "the cap on open HTTP connections (below the open-file limit)",
    "cachemgr_http_connections_closed_total": "HTTP connections the daemon closed, by reason: "
    "header_timeout, evicted (at the cap, for a new one), refused (at the cap, all busy)",
}


def _gauge(name: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, METRICS[name], labels=labels)


def _counter(name: str, labels: list[str] | None = None) -> CounterMetricFamily:
    return CounterMetricFamily(name, METRICS[name], labels=labels)


class Snapshot(NamedTuple):
    """What a scrape shows from the DB and the disk, as last read."""

    statuses: list[NamespaceStatus]
    audit: dict[tuple[str, str], AuditTotal]
    disk: DiskUsage | None


@dataclass(frozen=True)
class Parts:
    """The daemon's running parts whose state the metrics show (None or empty: not running)."""

    index: IndexState | None = None
    lag: Callable[[], float] = lambda: 0.0  # the index's, in seconds
    probe: Probe | None = None
    gc: GcRunner | None = None
    workers: Sequence[Worker] = ()
    quarantine: Quarantine | None = None


class CachemgrCollector(Collector):
    """Everything cachemgr exposes; register it in a CollectorRegistry."""

    def __init__(
        self,
        layout: Layout,
        reader: Reader,
        parts: Parts = Parts(),
        *,
        disk: Callable[[Layout], DiskUsage] = lambda lay: disk_usage(lay.root),
        dir_index: Callable[[Layout], DirIndex | None] = lambda lay: read_dir_index(lay.root),
        cached: bool = False,
    ) -> None:
        self.quarantine = parts.quarantine
        self.cached = cached  # scrapes render the last snapshot (a refresher keeps it fresh)
        self.snapshot: Snapshot | None = None
        self.workers = parts.workers
        self.layout = layout
        self.reader = reader
        self.index = parts.index
        self.lag = parts.lag
        self.probe = parts.probe
        self.disk = disk
        self.gc = parts.gc
        self.dir_index = dir_index
        self._index: tuple[DirIndex | None] | None = None  # read once (the filesystem stays)
        self.audit = AuditTotals()

    def describe(self) -> Iterator[Any]:
        return iter(())  # computed at scrape time; nothing to check at registration

    def refresh(self) -> Snapshot:
        """Read what comes from the DB and the disk (on the refresher's thread in the daemon)."""
        try:
            with self.reader() as conn:
                statuses = namespace_statuses(conn, self.layout)
                audit = self.audit.refresh(conn)
        except StateCorrupt:  # moved aside, rebuilt from disk: one snapshot without DB metrics
            statuses, audit = [], dict(self.audit.totals)
        try:
            disk: DiskUsage | None = self.disk(self.layout)
        except OSError:
            disk = None
        self.snapshot = Snapshot(statuses, audit, disk)
        return self.snapshot

    def collect(self) -> Iterator[Any]:
        snap = self.snapshot if self.snapshot is not None and self.cached else self.refresh()
        yield from self._namespaces(snap.statuses)
        yield from self._audit(snap.audit)
        yield from self._daemon()
        yield from self._disk(snap.disk)
        yield from self._probe_families()
        yield from self._gc()

    def _namespaces(self, statuses: list[Any]) -> Iterator[Any]:
        info = InfoMetricFamily(
            "cachemgr_namespace",
            METRICS["cachemgr_namespace_info"],
            # not `instance`: Prometheus's target label would rename it `exported_instance`
            labels=[*NS_ENGINE, "server_instance", "model", "kv_cache_dtype", "page_size"],
        )
        gauges = {
            k: _gauge(f"cachemgr_namespace_{k}", NS_ENGINE)
            for k in ("pages", "bytes", "temp_files", "foreign_files", "corrupt_pages")
        }
        reads = _counter("cachemgr_page_reads_total", NS_ENGINE)
        writes = _counter("cachemgr_page_writes_total", NS_ENGINE)
        live = self.index.counters if self.index is not None else {}
        for s in statuses:
            for inst in s.instances or ("",):
                labels = [
                    s.id,
                    s.engine,
                    inst,
                    s.model or "",
                    s.kv_cache_dtype or "",
                    str(s.page_size or ""),
                ]
                info.add_metric(labels, {})
            values = {
                "pages": s.pages,
                "bytes": s.bytes,
                "temp_files": s.temp_files,
                "foreign_files": s.foreign_files,
                "corrupt_pages": s.corrupt_files,
            }
            ids = [s.id, s.engine]
            for k, v in values.items():
                if v is not None:  # not counted (its dir cannot be read): no sample, not a 0
                    gauges[k].add_metric(ids, v)
            c = live.get(s.id)
            reads.add_metric(ids, c.reads if c else 0)
            writes.add_metric(ids, c.writes if c else 0)
        yield info
        yield from gauges.values()
        yield reads
        yield writes
        yield self._dir_entries(statuses)

    def _dir_entries(self, statuses: list[NamespaceStatus]) -> GaugeMetricFamily:
        """Each flat namespace dir's entries over its filesystem's one-dir limit."""
        family = _gauge("cachemgr_namespace_dir_entries_limit_ratio", NS_ENGINE)
        if self._index is None:
            try:
                self._index = (self.dir_index(self.layout),)
            except OSError:
                self._index = (None,)
        index = self._index[0]
        for s in statuses:
            limit, entries = s.entry_limit(index), s.dir_entries
            if limit and entries is not None:
                family.add_metric([s.id, s.engine], entries / limit)
        return family

    def _audit(self, audit: dict[tuple[str, str], Any]) -> Iterator[Any]:
        fams = {
            "evict": (
                _counter("cachemgr_evicted_pages_total", ["reason"]),
                _counter("cachemgr_evicted_bytes_total", ["reason"]),
            ),
            "purge": (
                _counter("cachemgr_purged_pages_total", ["reason"]),
                _counter("cachemgr_purged_bytes_total", ["reason"]),
            ),
        }
        purges = _counter("cachemgr_purges_total", ["reason"])
        for (action, reason), total in sorted(audit.items()):
            if action not in fams:
                continue
            pages, size = fams[action]
            pages.add_metric([reason], total.pages)
            size.add_metric([reason], total.bytes)
            if action == "purge":
                purges.add_metric([reason], total.count)
        for pages, size in fams.values():
            yield pages
            yield size
        yield purges

    def _daemon(self) -> Iterator[Any]:
        yield GaugeMetricFamily("cachemgr_up", METRICS["cachemgr_up"], value=1)
        build = InfoMetricFamily("cachemgr_build", METRICS["cachemgr_build_info"])
        build.add_metric([], {"version": __version__})
        yield build
        st = self.index
        ready = st is not None and st.ready.is_set()
        yield GaugeMetricFamily("cachemgr_ready", METRICS["cachemgr_ready"], value=int(ready))
        settled = st is not None and st.settled.is_set()
        name = "cachemgr_index_settled"
        yield GaugeMetricFamily(name, METRICS[name], value=int(settled))
        up = _gauge("cachemgr_worker_up", ["worker"])
        for w in self.workers:
            up.add_metric([w.name], int(w.up))
        yield up
        yield from self._unusable()
        name = "cachemgr_state_db_locked"
        yield GaugeMetricFamily(name, METRICS[name], value=int(busy.LOCKS.waiting > 0))
        yield _one("cachemgr_state_db_lock_wait_seconds_total", busy.LOCKS.seconds())
        if st is None:
            return
        yield GaugeMetricFamily(
            "cachemgr_index_leader", METRICS["cachemgr_index_leader"], value=int(st.leader)
        )
        # No `created`: each would add a `*_created` gauge per counter, noise for dashboards.
        # (prometheus_client.disable_created_metrics() covers its Counter class, not a
        # collector's families: a family has one only when given one.)
        for name, value in (
            ("cachemgr_scans_total", st.scans),
            ("cachemgr_scan_seconds_total", st.scan_seconds_total),
            ("cachemgr_index_drift_pages_total", st.drift_pages),
            ("cachemgr_watcher_overflows_total", st.overflows),
            ("cachemgr_index_events_total", st.events_applied),
            ("cachemgr_watch_gap_stores_total", st.watch_gaps.stores),
            ("cachemgr_watch_gap_reads_total", st.watch_gaps.reads),
            ("cachemgr_watches_refused_total", st.watch_gaps.refused),
        ):
            yield CounterMetricFamily(name, METRICS[name], value=value)
        yield GaugeMetricFamily(
            "cachemgr_watch_refused_namespaces",
            METRICS["cachemgr_watch_refused_namespaces"],
            value=st.watch_gaps.short,
        )
        yield GaugeMetricFamily(
            "cachemgr_watch_root_refused",
            METRICS["cachemgr_watch_root_refused"],
            value=int(st.watch_gaps.root),
        )
        yield GaugeMetricFamily(
            "cachemgr_last_scan_duration_seconds",
            METRICS["cachemgr_last_scan_duration_seconds"],
            value=st.last_scan_seconds,
        )
        yield GaugeMetricFamily(
            "cachemgr_index_lag_seconds", METRICS["cachemgr_index_lag_seconds"], value=self.lag()
        )

    def _unusable(self) -> Iterator[Any]:
        held = self.quarantine.held() if self.quarantine is not None else {}
        family = _gauge("cachemgr_namespace_unusable", ["namespace", "reason"])
        namespaces = self.quarantine.namespaces() if self.quarantine is not None else {}
        for ns, reasons in sorted(namespaces.items()):
            for reason in sorted(reasons):
                family.add_metric([ns, reason], 1)
        yield family
        for name, key in (
            ("cachemgr_root_unusable", ROOT),
            ("cachemgr_state_dir_unusable", STATE_DIR),
        ):
            yield GaugeMetricFamily(name, METRICS[name], value=int(key in held))

    def _disk(self, du: DiskUsage | None) -> Iterator[Any]:
        if du is None:
            return
        for name, value in (
            ("cachemgr_filesystem_avail_bytes", du.free),
            ("cachemgr_filesystem_size_bytes", du.total),
            ("cachemgr_filesystem_avail_inodes", du.free_inodes),
        ):
            yield GaugeMetricFamily(name, METRICS[name], value=value)

    def _probe_families(self) -> Iterator[Any]:
        p = self.probe.state if self.probe is not None else ProbeState()
        yield _one("cachemgr_identity_mismatches_total", p.mismatches)
        yield GaugeMetricFamily(
            "cachemgr_identity_mismatch", METRICS["cachemgr_identity_mismatch"], value=p.alarm
        )
        if self.probe is not None:
            yield from self.probe.families()

    def _gc(self) -> Iterator[Any]:
        if self.gc is None:
            return
        st = self.gc.stats
        leader = int(self.gc.leadership.held)
        yield GaugeMetricFamily("cachemgr_gc_leader", METRICS["cachemgr_gc_leader"], value=leader)
        runs = _counter("cachemgr_gc_runs_total", ["result"])
        for result in ("ok", "error", "skipped", "short"):
            runs.add_metric([result], getattr(st, result))
        yield runs
        refused = _counter("cachemgr_gc_refused_files_total", ["reason"])
        for reason, files in st.refused.items():
            refused.add_metric([reason], files)
        yield refused
        yield _one("cachemgr_gc_protection_overridden_total", st.overridden)
        unmet = GaugeMetricFamily(
            "cachemgr_gc_limits_unmet", METRICS["cachemgr_gc_limits_unmet"], labels=["limit"]
        )
        for limit in sorted(HOLDING):
            unmet.add_metric([limit], sum(u.reason == limit for u in st.unmet))
        yield unmet
        name = "cachemgr_gc_last_success_timestamp_seconds"
        yield GaugeMetricFamily(name, METRICS[name], value=st.last_success)
        name = "cachemgr_gc_audit_rows_held"
        yield GaugeMetricFamily(name, METRICS[name], value=len(self.gc.held))
        yield _one("cachemgr_gc_audit_rows_dropped_total", self.gc.held.dropped)
        name = "cachemgr_gc_model_keys_in_memory"
        yield GaugeMetricFamily(name, METRICS[name], value=self.gc.live.keys_in_memory())


def _one(name: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, METRICS[name], value=value)
