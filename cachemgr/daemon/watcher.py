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
* on <root>/ns: a namespace dir created, moved in, moved away or deleted

A kernel queue overflow (IN_Q_OVERFLOW, which watchdog only logs) becomes an OVERFLOW event so
the index rescans instead of drifting silently.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

from watchdog.observers.inotify_c import (
    CallbackId,
    InotifyConstants,
    InotifyEvent,
    InotifyFD,
    Mask,
    WatchDescriptor,
)

from cachemgr.backends import FileFormat
from cachemgr.layout import NS_ID_RE, Layout
from cachemgr.sglang.hicache import HICACHE_FILE

log = logging.getLogger(__name__)
C = InotifyConstants
_NS_MASK = Mask(C.IN_MOVED_TO | C.IN_MOVED_FROM | C.IN_DELETE | C.IN_CLOSE_NOWRITE)
_ROOT_MASK = Mask(C.IN_CREATE | C.IN_MOVED_TO | C.IN_MOVED_FROM | C.IN_DELETE)
_FLAGS = Mask(C.IN_ONLYDIR | C.IN_DONT_FOLLOW)
ACCESSES = 1 << 16  # page reads and stores remembered for GC (a run's worth at full speed)


class Kind(IntEnum):
    WRITE = 1
    GONE = 2
    READ = 3
    NS_ADDED = 4
    NS_GONE = 5
    OVERFLOW = 6


# (kind, namespace id, file name, time.monotonic() when seen)
Event = tuple[Kind, str, str, float]


@dataclass(eq=False)
class _NamespaceWatch:
    """The callback of one namespace dir's watch; dead once the dir was moved or deleted."""

    ns_id: str
    emit: Callable[[Event], None]
    clock: Callable[[], float]
    fmt: FileFormat
    wd: int = -1
    dead: bool = False

    def on_event(self, event: InotifyEvent) -> None:
        mask, name = event.mask, event.name
        if self.dead or mask & C.IN_ISDIR:
            return
        page = os.fsdecode(name)
        if not page.endswith(self.fmt.page_suffix) or self.fmt.key_len(page) is None:
            return  # a temp renamed away, "notes.bin", a non-UTF-8 name: never in the index
        if mask & C.IN_CLOSE_NOWRITE:
            kind = Kind.READ
        elif mask & C.IN_MOVED_TO:
            kind = Kind.WRITE
        else:
            kind = Kind.GONE
        self.emit((kind, self.ns_id, page, self.clock()))

    def on_watch_deleted(self, wd: WatchDescriptor) -> None:
        self.dead = True

    def on_queue_overflow(self) -> None:
        pass  # the root watch reports it once


@dataclass(eq=False)
class _RootWatch:
    """The callback of <root>/ns: namespace dirs appearing and disappearing, and overflows."""

    watcher: Watcher

    def on_event(self, event: InotifyEvent) -> None:
        if not event.mask & C.IN_ISDIR:
            return  # manifests and their temp files
        name = os.fsdecode(event.name)
        if not NS_ID_RE.fullmatch(name):
            return
        if event.mask & (C.IN_CREATE | C.IN_MOVED_TO):
            # Watch it right here, on the inotify thread: pages SGLang stores in a new dir
            # before the index thread gets to it would otherwise be found by the scan but
            # never counted as writes.
            self.watcher.watch(name)
            self.watcher.emit((Kind.NS_ADDED, name, "", self.watcher.clock()))
        else:
            self.watcher.mark_gone(name)

    def on_watch_deleted(self, wd: WatchDescriptor) -> None:
        if self.watcher.running:
            log.warning(
                "watch on the namespace root removed", extra={"root": str(self.watcher.layout.root)}
            )

    def on_queue_overflow(self) -> None:
        self.watcher.emit((Kind.OVERFLOW, "", "", self.watcher.clock()))


@dataclass(eq=False)
class Watcher:
    """Watches <root>/ns and each namespace dir; events go to `queue` for the index writer."""

    layout: Layout
    queue: deque[Event] = field(default_factory=deque)
    clock: Callable[[], float] = time.monotonic
    fmt: FileFormat = HICACHE_FILE
    on_store: Callable[[], None] = lambda: None  # on the inotify thread, for each page store
    # The latest page reads and stores as (namespace, name), and how many there were: what
    # GC asks before each chunk it deletes (cachemgr.daemon.backlog.Flight).
    accesses: deque[tuple[str, str]] = field(
        default_factory=lambda: deque(maxlen=ACCESSES), init=False
    )
    accessed: int = field(default=0, init=False)
    running: bool = field(default=False, init=False)
    _fd: InotifyFD | None = field(default=None, init=False)
    _watches: dict[str, _NamespaceWatch] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def emit(self, event: Event) -> None:
        kind = event[0]
        if kind is Kind.WRITE:
            self.on_store()
        if kind is Kind.WRITE or kind is Kind.READ:
            self.accesses.append((event[1], event[2]))
            self.accessed += 1
        self.queue.append(event)

    def start(self) -> None:
        """Start reading inotify and watch <root>/ns (before any scan, so nothing is missed)."""
        self._fd = InotifyFD()
        self._fd.daemon = True
        self._fd.start()
        root = _RootWatch(self)
        path = os.fsencode(self.layout.ns_root)
        self._fd.add_callback(path, Mask(_ROOT_MASK | _FLAGS), root, CallbackId(id(root)))
        self.running = True

    def stop(self) -> None:
        self.running = False
        if self._fd is not None:
            self._fd.stop()
            self._fd.join()
            self._fd = None

    def watch(self, ns_id: str) -> bool:
        """Start watching a namespace dir; False if it is gone. Call before scanning it."""
        assert self._fd is not None, "start() first"
        with self._lock:
            current = self._watches.get(ns_id)
        if current is not None and not current.dead:
            return True  # a second callback on the same watch would count every event twice
        cb = _NamespaceWatch(ns_id, self.emit, self.clock, self.fmt)
        path = os.fsencode(self.layout.ns_dir(ns_id))
        try:
            cb.wd = self._fd.add_callback(path, Mask(_NS_MASK | _FLAGS), cb, CallbackId(id(cb)))
        except OSError as e:
            if e.errno == 28:  # ENOSPC from inotify_add_watch: fs.inotify.max_user_watches
                log.error("inotify watch limit reached", extra={"sysctl": "max_user_watches"})
            return False
        with self._lock:
            old = self._watches.pop(ns_id, None)
            self._watches[ns_id] = cb
        if old is not None:
            self._remove(old)
        return True

    def unwatch(self, ns_id: str) -> None:
        """Stop watching a namespace dir (moved to the trash or deleted)."""
        with self._lock:
            cb = self._watches.pop(ns_id, None)
        if cb is not None:
            cb.dead = True
            self._remove(cb)

    def mark_gone(self, ns_id: str) -> None:
        """Called on the inotify thread when a namespace dir leaves <root>/ns."""
        with self._lock:
            cb = self._watches.get(ns_id)
            if cb is not None:
                # Later events of that watch describe the dir in .trash/, not the namespace.
                cb.dead = True
        self.emit((Kind.NS_GONE, ns_id, "", self.clock()))

    def _remove(self, cb: _NamespaceWatch) -> None:
        if self._fd is not None and cb.wd >= 0:
            self._fd.remove_callbacks([(WatchDescriptor(cb.wd), CallbackId(id(cb)))])
