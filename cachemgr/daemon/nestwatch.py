"""The watches of a nested namespace's dirs (cachemgr.backends.Nesting: vLLM's hashed dirs).

inotify is not recursive: every dir of the tree needs its own watch, added as the engine makes
the dir. vLLM makes a hashed dir and stores a file in it at once, so a file can land before its
dir's watch exists: a dir that appears is listed right after its watch is added, and what the
listing finds is counted as stored (`fresh`); a rename the kernel reports for a file the listing
counted already is dropped (watcher.SEEN_FOR). A read in that window (vLLM loads a block soon
after storing it, and a loaded watcher lags its queue by seconds) has no event, and inotify
cannot replay one: the file's atime can show it. A new leaf dir is listed once more just before
its watch is added, and each page whose atime is past its ctime and mtime there (relatime still
marks the first read after a store) is counted as read once. Such a read is held back until
the inotify thread has handled all the kernel queued (at most LATE_FOR): the stores of the dirs
made in the same lag come first, as they did, and the reads after them oldest first (the chain
model and GC's recency go by the order of events). What stays unseen, bounded: the
reads between that listing and the watch (microseconds, whatever the queue's lag), a page's
second read before the watch, and every read of the window on a root mounted noatime (its files
are the count `gaps.stores`; doctor says so). The dirs present when a namespace is first
watched, or scanned again (an inotify overflow lost their creation), are watched without
counting their files: the index scan finds those.

Only dirs whose names fit their level are watched, a top dir only if its identity file vouches
for it, and each dir is first opened without following a link (from the root, or from its
parent's descriptor when a listing finds it) and must be on the namespace dir's mount: a
symlink planted in the tree, or a mount, is never watched through.
"""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from cachemgr.daemon.events import LOCAL, Kind, WatchGaps
from cachemgr.errors import UnsafePathError
from cachemgr.fs.safe import open_dir, open_dir_at
from cachemgr.fs.tree import vouched
from cachemgr.layout import Layout


def _rel(cb: Any) -> str:
    """The dir a watch callback watches, relative to the root."""
    return f"ns/{cb.ns_id}/{cb.path}".rstrip("/")


def _own_dir(dir_fd: int, name: str) -> int:
    """A descriptor of dir `name` in `dir_fd` if it is on its mount (not a link, not a mount
    point), else -1."""
    try:
        with open_dir_at(dir_fd, name) as fd:
            return os.dup(fd)
    except (OSError, UnsafePathError):
        return -1


# How long a read found by a new dir's listing waits for the inotify thread to catch up, at
# most (an endless stream of events never lets it): it goes into the index that much later.
LATE_FOR = 1.0


class _Watcher(Protocol):
    @property
    def layout(self) -> Layout: ...
    @property
    def gaps(self) -> WatchGaps: ...
    def clock(self) -> float: ...

    def emit(self, event: Any) -> None: ...
    def add(self, cb: Any, path: Path, *, at: int = -1) -> bool: ...
    def _remove(self, cb: Any) -> None: ...


class NestWatches:
    """The watches below each nested namespace dir, added as its dirs appear."""

    def __init__(self, watcher: _Watcher) -> None:
        self.watcher = watcher
        self._subs: dict[str, dict[str, Any]] = {}  # namespace -> path -> its watch
        self._lock = threading.Lock()
        # reads found by listings, held back: (atime ns, namespace, name below its dir)
        self._late: list[tuple[int, str, str]] = []
        self._late_since = 0.0  # when the first of them was found (watcher clock)
        self._late_lock = threading.Lock()

    def added(
        self,
        parent: Any,
        name: str,
        *,
        fresh: bool = True,
        deep: bool = False,
        at: int = -1,
    ) -> None:
        """Dir `name` appeared in the watched dir `parent`: watch it if it is the engine's, and
        list it (`fresh`: its files were stored just now). `at`: the dir, opened already from
        its parent's descriptor, neither a link nor on another mount (`_watch_subdirs`):
        watched through that descriptor."""
        nesting = parent.fmt.nesting
        path = f"{parent.path}{name}/"
        if nesting is None or not nesting.dir_ok(parent.level, name):
            return
        with self._lock:
            old = self._watched(parent.ns_id, path)
        if old is not None:
            # a second callback on one watch would count every event twice; `deep` (a rescan
            # after an overflow) still looks below it for dirs made while events were lost
            if deep:
                self.below(old, fresh=False, deep=True)
            return
        layout = self.watcher.layout
        rel = f"ns/{parent.ns_id}/{parent.path}{name}"
        try:
            if parent.level == 0:
                with open_dir(layout.root, f"ns/{parent.ns_id}") as ns_fd:
                    if name not in vouched(ns_fd, nesting):
                        return
            if at < 0:
                # No link, no mount, and watched through the descriptor that found so: a mount
                # put over the path after a check by path would have had the watch (CI, once).
                with open_dir(layout.root, rel) as fd:
                    self.added(parent, name, fresh=fresh, deep=deep, at=fd)
                return
        except (OSError, UnsafePathError):
            return  # gone already, a link, another mount: never watched through
        child = replace(parent, path=path, level=parent.level + 1, wd=-1, dead=False, seen=None)
        read = self._read_already(child) if fresh and child.leaf else {}
        with self._lock:  # its creation event and its parent's listing may both get here
            if self._watched(parent.ns_id, path):
                return  # a second callback on one watch would count every event twice
            self._subs.setdefault(parent.ns_id, {})[path] = child
        if not self.watcher.add(child, layout.root / rel, at=at):
            with self._lock:
                self._subs.get(parent.ns_id, {}).pop(child.path, None)
            return
        self.below(child, fresh=fresh, read=read)

    def _watched(self, ns_id: str, path: str) -> Any:
        """The live watch of dir `path` of namespace `ns_id`, if any."""
        cb = self._subs.get(ns_id, {}).get(path)
        return cb if cb is not None and not cb.dead else None

    def _list(self, cb: Any) -> list[tuple[str, os.stat_result]] | None:
        """The entries of `cb`'s dir and their lstat; None if it cannot be listed."""
        try:
            with open_dir(self.watcher.layout.root, _rel(cb)) as fd, os.scandir(fd) as entries:
                return [(e.name, e.stat(follow_symlinks=False)) for e in entries]
        except (OSError, UnsafePathError):
            return None

    def _watch_subdirs(self, cb: Any, *, fresh: bool, deep: bool) -> None:
        """Watch the engine's dirs in `cb`'s dir, each opened from its descriptor (neither a
        link nor on another mount: no walk from the root each) and watched through that
        descriptor, so a dir of the path swapped for a link meanwhile leads nowhere else."""
        try:
            with open_dir(self.watcher.layout.root, _rel(cb)) as fd:
                with os.scandir(fd) as entries:
                    names = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
                for name in names:
                    child = _own_dir(fd, name)
                    if child < 0:
                        continue
                    try:
                        self.added(cb, name, fresh=fresh, deep=deep, at=child)
                    finally:
                        os.close(child)
        except (OSError, UnsafePathError):
            return

    def _read_already(self, cb: Any) -> dict[str, int]:
        """The pages of a new leaf dir read since their store, by atime (ns), before its watch."""
        return {
            name: st.st_atime_ns
            for name, st in self._list(cb) or ()
            if stat.S_ISREG(st.st_mode) and st.st_atime_ns > max(st.st_mtime_ns, st.st_ctime_ns)
        }

    def below(
        self, cb: Any, *, fresh: bool, deep: bool = False, read: dict[str, int] | None = None
    ) -> None:
        """Watch the engine's dirs already in `cb`'s dir; in a fresh leaf, count its pages as
        stored, then those in `read` (found read before the watch) as read, oldest read first."""
        if cb.fmt.nesting is None or (cb.leaf and not fresh):
            return  # (the pages of a dir that was there are the index scan's to find)
        if not cb.leaf:
            self._watch_subdirs(cb, fresh=fresh, deep=deep)
            return
        found = self._list(cb)
        if found is None:
            return
        now = self.watcher.clock()
        pages = [n for n, st in found if stat.S_ISREG(st.st_mode) and cb.fmt.key_len(n) is not None]
        if pages and cb.seen is None:
            cb.seen = {}
        for name in pages:
            cb.seen[name] = now
            self.watcher.emit((Kind.WRITE, cb.ns_id, cb.path + name, now, LOCAL))
        listed = set(pages)
        reads = [(at, cb.ns_id, cb.path + n) for n, at in (read or {}).items() if n in listed]
        with self._late_lock:
            if reads and not self._late:
                self._late_since = now
            self._late += reads
        self.watcher.gaps.stores += len(pages)
        self.watcher.gaps.reads += len(reads)

    def flush(self, *, idle: bool) -> None:
        """Emit the reads held back, oldest read first: once the inotify thread has handled all
        the kernel queued (`idle`), or once the first has waited LATE_FOR."""
        now = self.watcher.clock()
        with self._late_lock:
            if not self._late or not (idle or now - self._late_since >= LATE_FOR):
                return
            late, self._late = self._late, []
        for _, ns_id, name in sorted(late):
            self.watcher.emit((Kind.READ, ns_id, name, now, LOCAL))

    def moved(self, parent: Any, name: str) -> None:
        """Dir `name` left the watched dir `parent`: what its watches (and those below it)
        see now is not the namespace's."""
        gone = f"{parent.path}{name}/"
        with self._lock:
            subs = self._subs.get(parent.ns_id, {})
            left = [subs.pop(p) for p in [p for p in subs if p.startswith(gone)]]
        for cb in left:
            cb.dead = True
            self.watcher._remove(cb)

    def drop(self, ns_id: str) -> None:
        """Remove the watches below a namespace dir (unwatched, or watched again)."""
        with self._lock:
            subs = self._subs.pop(ns_id, {})
        for cb in subs.values():
            cb.dead = True
            self.watcher._remove(cb)

    def kill(self, ns_id: str) -> None:
        """The namespace dir left <root>/ns: what its watches see now is not the namespace."""
        with self._lock:
            for cb in self._subs.get(ns_id, {}).values():
                cb.dead = True
