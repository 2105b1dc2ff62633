"""The watches of a nested namespace's dirs (cachemgr.backends.Nesting: vLLM's hashed dirs).

inotify is not recursive: every dir of the tree needs its own watch, added as the engine makes
the dir. vLLM makes a hashed dir and stores a file in it at once, so a file can land before its
dir's watch exists: a dir that appears is listed right after its watch is added, and what the
listing finds is counted as stored (`fresh`); a rename the kernel reports for a file the listing
counted already is dropped (watcher.SEEN_FOR). The dirs present when a namespace is first
watched, or scanned again (an inotify overflow lost their creation), are watched without
counting their files: the index scan finds those.

Only dirs whose names fit their level are watched, a top dir only if its identity file vouches
for it, and each dir is first opened from the root without following a link and must be on the
namespace dir's mount: a symlink planted in the tree, or a mount, is never watched through.
"""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from cachemgr.daemon.events import Kind
from cachemgr.errors import UnsafePathError
from cachemgr.fs.safe import open_dir
from cachemgr.fs.tree import on_mount, vouched
from cachemgr.layout import Layout


class _Watcher(Protocol):
    @property
    def layout(self) -> Layout: ...
    def clock(self) -> float: ...

    def emit(self, event: Any) -> None: ...
    def add(self, cb: Any, path: Path) -> bool: ...
    def _remove(self, cb: Any) -> None: ...


class NestWatches:
    """The watches below each nested namespace dir, added as its dirs appear."""

    def __init__(self, watcher: _Watcher) -> None:
        self.watcher = watcher
        self._subs: dict[str, dict[str, Any]] = {}  # namespace -> path -> its watch
        self._lock = threading.Lock()

    def added(self, parent: Any, name: str, *, fresh: bool = True, deep: bool = False) -> None:
        """Dir `name` appeared in the watched dir `parent`: watch it if it is the engine's, and
        list it (`fresh`: its files were stored just now)."""
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
            on_mount(layout.root, f"ns/{parent.ns_id}", f"{parent.path}{name}")  # no link, no mount
        except (OSError, UnsafePathError):
            return  # gone already, a link, another mount: never watched through
        child = replace(parent, path=path, level=parent.level + 1, wd=-1, dead=False, seen={})
        with self._lock:  # its creation event and its parent's listing may both get here
            if self._watched(parent.ns_id, path):
                return  # a second callback on one watch would count every event twice
            self._subs.setdefault(parent.ns_id, {})[path] = child
        if not self.watcher.add(child, layout.root / rel):
            with self._lock:
                self._subs.get(parent.ns_id, {}).pop(child.path, None)
            return
        self.below(child, fresh=fresh)

    def _watched(self, ns_id: str, path: str) -> Any:
        """The live watch of dir `path` of namespace `ns_id`, if any."""
        cb = self._subs.get(ns_id, {}).get(path)
        return cb if cb is not None and not cb.dead else None

    def below(self, cb: Any, *, fresh: bool, deep: bool = False) -> None:
        """Watch the engine's dirs already in `cb`'s dir; in a fresh leaf, count its pages."""
        if cb.fmt.nesting is None:
            return
        rel = f"ns/{cb.ns_id}/{cb.path}".rstrip("/")
        try:
            with open_dir(self.watcher.layout.root, rel) as fd, os.scandir(fd) as entries:
                found = [(e.name, e.stat(follow_symlinks=False).st_mode) for e in entries]
        except (OSError, UnsafePathError):
            return
        if not cb.leaf:
            for name, mode in found:
                if stat.S_ISDIR(mode):
                    self.added(cb, name, fresh=fresh, deep=deep)
            return
        if fresh:
            now = self.watcher.clock()
            for name, mode in found:
                if stat.S_ISREG(mode) and cb.fmt.key_len(name) is not None:
                    cb.seen[name] = now
                    self.watcher.emit((Kind.WRITE, cb.ns_id, cb.path + name, now))

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
