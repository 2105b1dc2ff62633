"""Page events from inotify: stores, deletions and reads of page files, per namespace.

Built on watchdog's inotify layer (`InotifyFD` and its `WatchCallback` protocol) rather than
`InotifyObserver`: the observer turns each kernel event into several Python objects, pairs
moves through a 0.5 s delay queue and dispatches through two more threads, which tops out near
7K events/s per core (FIELD_NOTES §7), while SGLang can store 13–20K pages/s. Here one thread
reads the kernel queue and appends plain tuples to a deque, and only the event kinds that
matter are asked of the kernel:

* IN_MOVED_TO a page        a page store (SGLang writes a temp file, then os.replace)
* IN_CLOSE_NOWRITE a page   a page read (one per read; IN_OPEN would only double the work)
* IN_DELETE / IN_MOVED_FROM a page deleted or moved away
* on <root>/ns: a namespace dir created, moved in, moved away or deleted, and a manifest
  written (its engine may make the dir a nested one)

A nested format (vLLM's hashed dirs, cachemgr.backends.Nesting) gets a watch on every dir of
the tree (cachemgr.daemon.nestwatch): inotify is not recursive, and the engine makes its dirs
on the fly, each just before a file is stored in it.

A kernel queue overflow (IN_Q_OVERFLOW, which watchdog only logs) becomes an OVERFLOW event so
the index rescans instead of drifting silently.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import os
import struct
import termios
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from watchdog.observers.inotify_c import (
    DEFAULT_EVENT_BUFFER_SIZE,
    CallbackId,
    InotifyConstants,
    InotifyEvent,
    InotifyFD,
    Mask,
    WatchDescriptor,
)
from watchdog.version import VERSION_STRING as watchdog_version

from cachemgr.backends import FileFormat
from cachemgr.daemon.events import LOCAL, Event, Kind, WatchGaps
from cachemgr.daemon.nestwatch import NestWatches
from cachemgr.daemon.owndeletes import OwnDeletions
from cachemgr.errors import ConfigError
from cachemgr.fs.usage import atime_off
from cachemgr.layout import NS_ID_RE, Layout
from cachemgr.ns.manifest import format_of

log = logging.getLogger(__name__)
C = InotifyConstants
# A refused watch is logged at most this often (seconds): a vLLM tree past the limit refuses
# one a dir, hundreds of thousands in a row.
REFUSALS_LOGGED_EVERY = 600.0
MAX_USER_WATCHES = Path("/proc/sys/fs/inotify/max_user_watches")
_PROC_FD = Path("/proc/self/fd")
_NS_MASK = Mask(C.IN_MOVED_TO | C.IN_MOVED_FROM | C.IN_DELETE | C.IN_CLOSE_NOWRITE)
_ROOT_MASK = Mask(C.IN_CREATE | C.IN_MOVED_TO | C.IN_MOVED_FROM | C.IN_DELETE)
_TREE_MASK = Mask(C.IN_CREATE | C.IN_MOVED_TO | C.IN_MOVED_FROM)  # a dir above the files
_FLAGS = Mask(C.IN_ONLYDIR | C.IN_DONT_FOLLOW)
ACCESSES = 1 << 16  # page reads and stores remembered for GC (a run's worth at full speed)
SHIPPED_DIR_EVENTS = (Kind.NS_GONE, Kind.NS_ADDED)  # besides accesses, for `on_access`


# How long a page a new dir's listing found hides the rename event the kernel may still hold
# for it (the file was stored between the watch and the listing): counted once, not twice.
SEEN_FOR = 5.0


@dataclass(eq=False, slots=True)  # (slots: one a watched dir, a million in a vLLM tree)
class _DirWatch:
    """The callback of one watched dir of a namespace: the namespace dir itself, or (nested
    format) one of its dirs `path` below it at `level`; dead once moved or deleted."""

    ns_id: str
    watcher: Watcher
    fmt: FileFormat
    path: str = ""  # "" or "<dir>/.../" below the namespace dir
    level: int = 0  # of the dirs its entries are: 0 in the namespace dir
    wd: int = -1
    dead: bool = False
    seen: dict[str, float] | None = None  # found by listing a new dir (None: none were)
    born: bool = False  # watched as it was made: all it holds was stored since

    @property
    def leaf(self) -> bool:
        """Whether page files sit here (not a dir above them)."""
        return self.level == (len(self.fmt.nesting.levels) if self.fmt.nesting else 0)

    def on_event(self, event: InotifyEvent) -> None:
        mask, name = event.mask, os.fsdecode(event.name)
        if self.dead:
            return
        if mask & C.IN_ISDIR:
            if not self.leaf and mask & (C.IN_CREATE | C.IN_MOVED_TO):
                self.watcher.nest.added(self, name)
            elif not self.leaf and mask & C.IN_MOVED_FROM:
                self.watcher.nest.moved(self, name)
                # its files left without an event each (an mv, not an rm -r): scan again
                self.watcher.emit((Kind.NS_ADDED, self.ns_id, "", self.watcher.clock(), LOCAL))
            return
        if not self.leaf:
            return
        if not name.endswith(self.fmt.page_suffix) or self.fmt.key_len(name) is None:
            return  # a temp renamed away, "notes.bin", a non-UTF-8 name: never in the index
        now = self.watcher.clock()
        if mask & C.IN_CLOSE_NOWRITE:
            kind = Kind.READ
        elif mask & C.IN_MOVED_TO:
            kind = Kind.WRITE
            if self.seen and self.seen.pop(name, -SEEN_FOR) > now - SEEN_FOR:
                return  # the listing of this new dir counted it already
            self.watcher.own.stored(self.ns_id, self.path + name)  # (GC may be recording it gone)
        else:  # (GC's own deletions never get here: Watcher.own_deletion)
            kind = Kind.GONE
        self.watcher.emit((kind, self.ns_id, self.path + name, now, LOCAL))

    def on_watch_deleted(self, wd: WatchDescriptor) -> None:
        self.dead = True
        self.watcher.unleaf(self)

    def on_queue_overflow(self) -> None:
        pass  # the reader reports it once (_Reader._handle)

    def on_events_lost(self) -> None:
        pass  # (watchdog 7.1.1 on: after every watch's on_queue_overflow; the root's reported it)


@dataclass(eq=False)
class _RootWatch:
    """The callback of <root>/ns: namespace dirs appearing and disappearing, and overflows."""

    watcher: Watcher
    wd: int = -1
    at: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the dir it was put on
    dead: bool = False  # the kernel removed it (that dir was deleted)

    def on_event(self, event: InotifyEvent) -> None:
        name = os.fsdecode(event.name)
        if not event.mask & C.IN_ISDIR:
            stem, _, ext = name.partition(".")
            if event.mask & C.IN_MOVED_TO and ext == "json" and self.watcher.has(stem):
                # a new namespace's manifest: the engine may be another, and what its dirs hold
                # was stored since the dir was made
                self.watcher.watch(stem, fresh=True)
            return
        if not NS_ID_RE.fullmatch(name):
            return
        if event.mask & (C.IN_CREATE | C.IN_MOVED_TO):
            # Watch it right here, on the inotify thread: pages SGLang stores in a new dir
            # before the index thread gets to it would otherwise be found by the scan but
            # never counted as writes. A dir made (not moved in) holds only what was stored
            # since: what a nested one's listing finds is counted so (this thread may get to
            # the dir late, its manifest and first blocks written: they were not counted).
            self.watcher.watch(name, fresh=bool(event.mask & C.IN_CREATE))
            self.watcher.emit((Kind.NS_ADDED, name, "", self.watcher.clock(), LOCAL))
        else:
            self.watcher.mark_gone(name)

    def on_watch_deleted(self, wd: WatchDescriptor) -> None:
        self.dead = True
        if self.watcher.running:
            log.warning(
                "watch on the namespace root removed", extra={"root": str(self.watcher.layout.root)}
            )

    def on_queue_overflow(self) -> None:
        pass  # the reader reports it (_Reader._handle), whether this watch was taken or not

    def on_events_lost(self) -> None:
        pass  # (watchdog 7.1.1 on: after every on_queue_overflow)


class _Reader(InotifyFD):
    """watchdog's reader loop, and after each buffer of events it handled, `caught_up` told
    whether the kernel holds more (FIONREAD): reads a new dir's listing found wait for that.

    GC's own deletions (`own`: a file's IN_DELETE by watch descriptor and raw name) are dropped
    as the buffer is parsed: in an eviction nearly every event is one, and watchdog's event
    object, its dispatch under a lock and the callback's name parsing cost each several times
    the look-up that drops it (bench/RESULTS.md)."""

    def __init__(
        self,
        caught_up: Callable[[bool], None],
        own: Callable[[int, bytes], bool],
        failed: Callable[[], None],
    ):
        super().__init__()
        self.caught_up = caught_up
        self.own = own
        self.failed = failed  # events were lost: every namespace is listed again
        self._said_at = -math.inf

    def run(self) -> None:
        while self.should_keep_running():
            buffer = self._read_event_buffer(BUFFER)
            self._handle(buffer)
            self.caught_up(_queued(self._inotify_fd) == 0)
            if len(buffer) < BUFFER // 2:
                # Events come one unlink or store at a time: woken for each few, the thread
                # spends more on the wake (poll, read, FIONREAD, the GIL) than on them.
                time.sleep(GATHER)

    def _handle(self, buffer: bytes) -> None:
        """The buffer's events, each to its callback. One that raises (a bug) must not end
        this thread, the only one that hears the disk: what is left of the buffer is lost as
        in an overflow, and found again the same way, by a rescan (said once a minute)."""
        try:
            for event in self.events(buffer):
                if event.mask & C.IN_Q_OVERFLOW:
                    # Said here, not by a watch's callback: <root>/ns may have none (refused).
                    self.failed()
                    continue
                self.handle_event(event)
        except Exception:
            now = time.monotonic()
            if now - self._said_at >= 60:
                self._said_at = now
                log.exception("inotify events not handled; rescanning every namespace")
            self.failed()

    def events(self, buffer: bytes) -> list[InotifyEvent]:
        """watchdog's `read_events` of one buffer (`struct inotify_event`s; the kernel's
        global events dropped but an overflow), less GC's own deletions."""
        out = []
        at, end, own = 0, len(buffer), self.own
        while at + _HEADER.size <= end:
            wd, mask, cookie, length = _HEADER.unpack_from(buffer, at)
            name = buffer[at + _HEADER.size : at + _HEADER.size + length].rstrip(b"\0")
            at += _HEADER.size + length
            if mask == C.IN_DELETE and own(wd, name):
                continue
            if wd != -1 or mask & C.IN_Q_OVERFLOW:
                out.append(InotifyEvent(wd, mask, cookie, name))
        return out


_HEADER = struct.Struct("iIII")  # struct inotify_event before its name: wd, mask, cookie, len
BUFFER = DEFAULT_EVENT_BUFFER_SIZE  # bytes read at once, as watchdog reads them
GATHER = 0.002  # seconds the kernel gathers events after a small read before the next


def _queued(fd: int) -> int:
    """Bytes of events the kernel holds for inotify `fd` (0 once it is closed)."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0])
    except OSError:
        return 0


@dataclass(eq=False)
class Watcher:
    """Watches <root>/ns and each namespace dir; events go to `queue` for the index writer."""

    layout: Layout
    queue: deque[Event] = field(default_factory=deque)
    # Events the index took from the queue and has not committed yet (its thread replaces
    # the list, never empties it): what GC must see beside the queue (backlog.Flight).
    applying: list[Event] = field(default_factory=list, init=False)
    clock: Callable[[], float] = time.monotonic
    # which format a namespace's dir follows; read again when its manifest is written
    formats: Callable[[Layout, str], FileFormat] = format_of
    # (namespace, name) of each page store, on the inotify thread
    on_store: Callable[[str, str], None] = lambda ns, name: None
    # Each page read or store, and each namespace dir gone or made, on the thread that saw it
    # (fleet mode ships them to the leader, whose inotify sees only its own mount's).
    on_access: Callable[[Event], None] | None = None
    # The latest page reads and stores (their events: each one object, which GC tells from
    # another seen alike), and how many there were: what GC asks before each chunk it deletes
    # (cachemgr.daemon.backlog.Flight).
    accesses: deque[Event] = field(default_factory=lambda: deque(maxlen=ACCESSES), init=False)
    accessed: int = field(default=0, init=False)
    # what new nested dirs held before their watches (the index's state shares it: metrics)
    gaps: WatchGaps = field(default_factory=WatchGaps)
    # the page files GC is deleting: their deletions are not queued (daemon.owndeletes)
    own: OwnDeletions = field(default_factory=OwnDeletions)
    running: bool = field(default=False, init=False)
    _fd: InotifyFD | None = field(default=None, init=False)
    _watches: dict[str, _DirWatch] = field(default_factory=dict, init=False)
    # The dir of page files each watch descriptor watches (the latest callback on it)
    _leaves: dict[int, _DirWatch] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _watching: threading.RLock = field(default_factory=threading.RLock, init=False)  # (watch)
    # watched before an overflow: dirs made since may have lost their creation event
    _stale: set[str] = field(default_factory=set, init=False)
    # namespaces a watch was refused in (the kernel's limit), and those whose own dir's was:
    # scanned all the same, and every dir of theirs tried again at the next reconcile
    _short: set[str] = field(default_factory=set, init=False)
    _unwatched: set[str] = field(default_factory=set, init=False)
    _refusal_logged: float = field(default=-math.inf, init=False)
    nest: NestWatches = field(init=False)
    _root: _RootWatch | None = field(default=None, init=False)  # the watch of <root>/ns

    def __post_init__(self) -> None:
        self.nest = NestWatches(self)
        self.own.lost = self._deleted_elsewhere

    def _deleted_elsewhere(self, ns_id: str, names: list[str]) -> None:
        """Deletions dropped as GC's that GC did not make (owndeletes): queued after all,
        unless the namespace's dir left meanwhile (a purge: its rows go with it)."""
        with self._lock:
            cb = self._watches.get(ns_id)
        if cb is None or cb.dead:
            return
        for name in names:
            self.emit((Kind.GONE, ns_id, name, self.clock(), LOCAL))

    def emit(self, event: Event) -> None:
        kind = event[0]
        if kind is Kind.WRITE:
            self.on_store(event[1], event[2])
        if kind is Kind.WRITE or kind is Kind.READ:
            self.accesses.append(event)
            self.accessed += 1
            if self.on_access is not None:
                self.on_access(event)
        elif kind in SHIPPED_DIR_EVENTS and self.on_access is not None:
            self.on_access(event)  # a purge through this node's mount: the leader's index too
        self.queue.append(event)

    def start(self) -> None:
        """Start reading inotify and watch <root>/ns (before any scan, so nothing is missed)."""
        if not callable(getattr(InotifyFD, "_read_event_buffer", None)):
            # (a private method: a watchdog release may rename it, and the reader would die
            # at its first read, after the daemon said it was ready)
            raise ConfigError(
                f"watchdog {watchdog_version} lacks the inotify internals the watcher reads"
                " (InotifyFD._read_event_buffer): install watchdog>=7.1,<8 as pyproject.toml"
                " says"
            )
        self._fd = _Reader(lambda idle: self.nest.flush(idle=idle), self.own_deletion, self.lost)
        self._fd.daemon = True
        self._fd.start()
        root: _RootWatch | None = None
        try:
            root = self._add_root()
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            # Another program took every watch of this user (an IDE, a vLLM tree's daemon):
            # the daemon runs all the same, on its reconcile scans, which ask again.
            self._refused(None, "")
        self._set_root(root)
        self.running = True
        if atime_off(self.layout.ns_root):  # (cachemgr.daemon.nestwatch)
            log.warning(
                "root mounted noatime: reads in a new nested dir before its watch are lost",
                extra={"root": str(self.layout.root), "metric": "cachemgr_watch_gap_stores_total"},
            )

    def _set_root(self, root: _RootWatch | None) -> None:
        """<root>/ns's watch, or None when the kernel refused it (said: WatchGaps.root)."""
        self._root = root
        self.gaps.root = root is None

    def _add_root(self) -> _RootWatch:
        assert self._fd is not None, "start() first"
        root = _RootWatch(self)
        path = os.fsencode(self.layout.ns_root)
        root.wd = self._fd.add_callback(path, Mask(_ROOT_MASK | _FLAGS), root, CallbackId(id(root)))
        st = os.stat(self.layout.ns_root, follow_symlinks=False)
        root.at = (st.st_dev, st.st_ino)
        return root

    def watch_root(self) -> None:
        """<root>/ns usable again after it was removed, moved or replaced: the kernel's watch
        stayed on the dir it was put on (gone, or moved elsewhere), so new namespace dirs in
        the one there now would be found by the reconcile scans only. Put it on that one."""
        old = self._root
        try:
            st = os.stat(self.layout.ns_root, follow_symlinks=False)
        except OSError:
            return  # (the index holds the root aside again)
        if old is not None and not old.dead and old.at == (st.st_dev, st.st_ino):
            return  # the same dir (made unreadable and readable again): its watch holds
        new: _RootWatch | None = None
        try:
            new = self._add_root()
        except OSError as e:  # gone again, a symlink again, or no watch left: the next retry
            if e.errno != errno.ENOSPC:  # tries again
                log.warning("namespace root not watched", extra={"error": str(e)})
                return
            # No watch left for the dir there now: the old one (dead, or on a dir moved away,
            # whose events are not the root's) goes all the same, and root_refused() has the
            # reconcile ask again.
            self._refused(None, "")
        self._set_root(new)
        if old is not None and not old.dead and self._fd is not None:
            self._fd.remove_callbacks([(WatchDescriptor(old.wd), CallbackId(id(old)))])

    def stop(self) -> None:
        self.running = False
        if self._fd is not None:
            self._fd.stop()
            self._fd.join()
            self._fd = None

    def own_deletion(self, wd: int, name: bytes) -> bool:
        """On the inotify thread, for a file's IN_DELETE: whether GC made it (it dropped the
        row, the model forgot the page: cachemgr.daemon.owndeletes), so it is not news."""
        cb = self._leaves.get(wd)
        if cb is None or cb.dead:
            return False
        return self.own.take(cb.ns_id, cb.path + os.fsdecode(name))

    def format_of(self, ns_id: str) -> FileFormat:
        return self.formats(self.layout, ns_id)

    def lost(self) -> None:
        """Events were lost (the kernel's queue overflowed, or a callback failed): the index
        rescans every namespace (an OVERFLOW event)."""
        self.overflowed()
        self.emit((Kind.OVERFLOW, "", "", self.clock(), LOCAL))

    def overflowed(self) -> None:
        """The kernel dropped events: every watched namespace's dirs are listed again by the
        rescan that follows (a walk of every dir: only then, not at each reconcile)."""
        with self._lock:
            self._stale |= set(self._watches)
        self.own.clear()  # (the deletions GC expects may be among those lost)

    def has(self, ns_id: str) -> bool:
        with self._lock:
            return ns_id in self._watches

    def watch(self, ns_id: str, *, fresh: bool = False) -> bool:
        """Start watching a namespace dir (and, nested, every dir in it); False if it is gone
        or the kernel refused its watch (`refused`). Call before scanning it. Watched already
        with the format it has: nothing to do. `fresh`: the pages found in its dirs were just
        stored (counted as writes)."""
        # One at a time: the inotify thread (a new dir, its manifest) and the index thread (its
        # scan) may both replace a namespace's watch, each with its own callbacks on the same
        # kernel watches: events counted twice, one's sub-watches dropped by the other and
        # removed twice (watchdog's warning, an error under the tests: the inotify thread's
        # buffer lost, every namespace rescanned, its first stores never counted; CI).
        with self._watching:
            refused = self.gaps.refused
            watched = self._watch(ns_id, fresh)
            if self.gaps.refused == refused:  # every dir it wants is watched (or it is gone)
                self._all_watched(ns_id)
            return watched

    def _watch(self, ns_id: str, fresh: bool) -> bool:
        assert self._fd is not None, "start() first"
        fmt = self.format_of(ns_id)
        with self._lock:
            current = self._watches.get(ns_id)
        if current is not None and not current.dead and current.fmt is fmt:
            # A second callback on the same watch would count every event twice. A top dir
            # vouched for since is watched now; after an overflow, every dir made meanwhile,
            # and after a refusal every dir not watched (a walk of the whole tree: only then)
            with self._lock:
                deep = ns_id in self._stale or ns_id in self._short
                self._stale.discard(ns_id)
            self.nest.below(current, fresh=False, deep=deep)
            return True
        # A dir watched as it was made stays so when its manifest changes its format: the index
        # thread's scan of the new namespace may watch it nested (not fresh) before this thread
        # gets to the manifest's event, and its first stores were then never counted (CI).
        fresh = fresh or (current is not None and not current.dead and current.born)
        cb = _DirWatch(ns_id, self, fmt, born=fresh)
        if not self.add(cb, self.layout.ns_dir(ns_id)):
            return False
        with self._lock:
            self._unwatched.discard(ns_id)
            old = self._watches.pop(ns_id, None)
            self._watches[ns_id] = cb
        if old is not None:
            self._remove(old)
        self.nest.drop(ns_id)
        self.nest.below(cb, fresh=fresh)
        return True

    def _all_watched(self, ns_id: str) -> None:
        """No watch was refused in the namespace since its dirs were last walked (another
        namespace's refusal meanwhile keeps it flagged: one more walk, at the next reconcile)."""
        with self._lock:
            self._short.discard(ns_id)
            self._unwatched.discard(ns_id)
            self.gaps.short = len(self._short)

    def add(self, cb: _DirWatch, path: Path, *, at: int = -1) -> bool:
        """Add the kernel watch of `cb` on `path`, or on the dir open at descriptor `at`
        (through /proc: that very dir, whatever its path leads to now); False if that dir is
        gone or no watch is left (fs.inotify.max_user_watches, logged)."""
        assert self._fd is not None, "start() first"
        mask = _NS_MASK if cb.leaf else _TREE_MASK
        target, flags = os.fsencode(path), _FLAGS
        if at >= 0 and _PROC_FD.is_dir():  # (the /proc link must be followed, to the dir)
            target, flags = os.fsencode(_PROC_FD / str(at)), Mask(C.IN_ONLYDIR)
        try:
            cb.wd = self._fd.add_callback(target, Mask(mask | flags), cb, CallbackId(id(cb)))
        except OSError as e:
            if e.errno == 28:  # ENOSPC from inotify_add_watch: fs.inotify.max_user_watches
                self._refuse(cb)
            return False
        if cb.leaf:
            self._leaves[cb.wd] = cb
        return True

    def root_refused(self) -> bool:
        """Whether <root>/ns has no watch because the kernel had none left: new namespace
        dirs are then found by the reconcile scans, which ask for it again (watch_root)."""
        return self.running and self._root is None

    def _refuse(self, cb: _DirWatch) -> None:
        """The kernel has no watch left for `cb`'s dir: what happens in it is seen by the
        reconcile scans only, which try its watch again."""
        with self._lock:
            self._short.add(cb.ns_id)
            if not cb.path:
                self._unwatched.add(cb.ns_id)
            self.gaps.short = len(self._short)
        self._refused(cb.ns_id, cb.path)

    def _refused(self, ns_id: str | None, path: str) -> None:
        """A watch refused (None: <root>/ns's own), counted (metrics, /v1/status, doctor) and
        logged at most every REFUSALS_LOGGED_EVERY seconds."""
        self.gaps.refused += 1
        self.gaps.refused_at = time.time()
        now = self.clock()
        if now - self._refusal_logged < REFUSALS_LOGGED_EVERY:
            return
        self._refusal_logged = now
        try:
            limit: int | None = int(MAX_USER_WATCHES.read_text())
        except (OSError, ValueError):
            limit = None
        log.error(
            "inotify watch limit reached: the reads and stores of dirs without a watch are seen"
            " by the reconcile scans only; raise fs.inotify.max_user_watches",
            extra={
                "namespace": ns_id,
                "dir": path if ns_id is not None else str(self.layout.ns_root),
                "refused": self.gaps.refused,
                "max_user_watches": limit,
            },
        )

    def refused(self, ns_id: str) -> bool:
        """Whether the kernel refused the namespace dir's own watch (the dir is there: scan
        it all the same)."""
        with self._lock:
            return ns_id in self._unwatched

    def unwatch(self, ns_id: str) -> None:
        """Stop watching a namespace dir (moved to the trash or deleted)."""
        with self._watching:
            with self._lock:
                cb = self._watches.pop(ns_id, None)
            self._all_watched(ns_id)  # (gone: none of its dirs is wanted now)
            if cb is not None:
                cb.dead = True
                self._remove(cb)
            self.nest.drop(ns_id)

    def mark_gone(self, ns_id: str) -> None:
        """Called on the inotify thread when a namespace dir leaves <root>/ns."""
        with self._lock:
            cb = self._watches.get(ns_id)
            if cb is not None:
                # Later events of that watch describe the dir in .trash/, not the namespace.
                cb.dead = True
        self.nest.kill(ns_id)
        self.own.forget(ns_id)
        self.emit((Kind.NS_GONE, ns_id, "", self.clock(), LOCAL))

    def unleaf(self, cb: _DirWatch) -> None:
        """`cb` watches no more (its kernel watch is gone or being removed)."""
        if self._leaves.get(cb.wd) is cb:  # (a dir watched again shares its descriptor)
            self._leaves.pop(cb.wd, None)  # (the inotify and the index threads both may)

    def _remove(self, cb: _DirWatch) -> None:
        self.unleaf(cb)
        if self._fd is not None and cb.wd >= 0:
            self._fd.remove_callbacks([(WatchDescriptor(cb.wd), CallbackId(id(cb)))])
