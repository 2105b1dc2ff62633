"""Namespaces the daemon cannot use, held aside instead of failing a scan or a GC cycle.

A namespace dir another user made (0755: readable, its pages not deletable), one the daemon
cannot read (0700 of another owner, `chmod 000`), a root whose ns/ became unreadable, was
removed, or was replaced by a symlink or a file (ns_root_problem), or a state dir it may no
longer use, is outside the daemon's control. The index and GC skip it and go on with the
others; each entry is logged once when found and once when it is usable again, shown in
`cachemgr_namespace_unusable{namespace,reason}` / `cachemgr_root_unusable` /
`cachemgr_state_dir_unusable`, in /readyz's detail, and by doctor (cachemgr.doctor.root).
Whoever finds it usable again clears it.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from dataclasses import dataclass, field
from typing import Literal

from cachemgr.fs import reserve
from cachemgr.fs.deletecheck import DENIED
from cachemgr.layout import Layout
from cachemgr.state.dbfile import unavailable

log = logging.getLogger(__name__)
# "full": the state dir's filesystem refused the DB a write for lack of space.
Reason = Literal["unreadable", "not-writable", "full"]
ROOT = ""  # the key of the root itself (its ns/ dir cannot be listed)
# The key of the state dir: the pages and ns/ are still there and SGLang serves them; only
# what needs the DB (the index, GC, purge) waits: the root is not unusable.
STATE_DIR = "/state-dir"
_WHAT = {ROOT: "root", STATE_DIR: "state dir"}


def is_denied(error: BaseException) -> bool:
    """Whether `error` is the kernel refusing access (mode bits, an ACL, a foreign owner)."""
    return isinstance(error, OSError) and error.errno in DENIED


def ns_root_problem(layout: Layout) -> str | None:
    """Why <root>/ns cannot be the namespaces' dir now, else None: gone, a symlink (never
    followed: its pages would be another tree's), not a dir, or not listable by this process.
    An lstat and an access: cheap enough for every index batch."""
    path = layout.ns_root
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"{path}: {e.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink (never followed)"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if not os.access(path, os.R_OK | os.X_OK):
        return f"{path} cannot be listed by uid {os.geteuid()}"
    return None


def denied_key(layout: Layout) -> str:
    """What a refused access of the index or GC says is unusable: the root if its ns/ cannot
    be listed (a root made unreadable takes its state dir too), else the state dir if this
    process may not use it now, else the root."""
    if ns_root_problem(layout) is not None:
        return ROOT
    return STATE_DIR if unavailable(layout.state_dir, layout.db_path) is not None else ROOT


def state_dir_full(layout: Layout) -> str:
    """What a state dir whose filesystem is full is, and who frees it: GC frees space on the
    root's filesystem only, so on any other one a person has to."""
    state = layout.state_dir
    try:
        ours = reserve.shares_root_fs(state, layout.root)
    except OSError:
        return f"the filesystem of {state} is full"
    if ours:
        return f"the filesystem of {state} is full; it is the root's, and GC frees space there"
    return (
        f"the filesystem of {state} is full; it is not the root's ({layout.root}), where GC "
        "frees space: free space on it, or move the state dir"
    )


def unreadable_problem(error: OSError) -> str:
    """Why a namespace's pages are not known, as `ls` and `status` show it."""
    return f"cannot be read by uid {os.geteuid()}: {error.strerror}"


@dataclass
class Quarantine:
    """What is held aside now: key (a namespace id, or ROOT) -> {reason: the error seen}.

    One key may be held for both reasons (GC found its pages not deletable, then the index
    found it unreadable): each is said, and cleared, on its own. Bounded: two reasons a key.
    """

    _held: dict[str, dict[Reason, str]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def mark(self, key: str, reason: Reason, error: BaseException | str) -> None:
        """Hold `key` aside for `reason`; logged only when it was not held for it already."""
        with self._lock:
            reasons = self._held.setdefault(key, {})
            new = reason not in reasons
            reasons[reason] = str(error)
        if new and key in _WHAT:
            log.error(
                f"{_WHAT[key]} unusable; the daemon waits for it",
                extra={"reason": reason, "error": str(error)},
            )
        elif new:
            log.warning(
                "namespace unusable; skipped",
                extra={"namespace": key, "reason": reason, "error": str(error)},
            )

    def clear(self, key: str, reason: Reason) -> None:
        """`key` was just used for what `reason` says it could not be: usable for it again."""
        with self._lock:
            reasons = self._held.get(key, {})
            if reason not in reasons:
                return
            del reasons[reason]
            if not reasons:
                del self._held[key]
        what = _WHAT.get(key, "namespace")
        log.warning(f"{what} usable again", extra={"namespace": key, "reason": reason})

    def namespaces(self) -> dict[str, dict[Reason, str]]:
        """What is held aside by namespace id (the root and the state dir left out)."""
        return {key: why for key, why in self.held().items() if key not in _WHAT}

    def held(self) -> dict[str, dict[Reason, str]]:
        with self._lock:
            return {key: dict(reasons) for key, reasons in self._held.items()}

    def holds(self, key: str, reason: Reason) -> bool:
        """Whether `key` is held aside for `reason`."""
        with self._lock:
            return reason in self._held.get(key, {})

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._held

    def degraded(self) -> str | None:
        """What /readyz says while anything is held aside, else None."""
        held = self.held()
        if not held:
            return None
        parts = [
            f"{_WHAT[key]} {why}: {err}" if key in _WHAT else f"namespace {key} {why}"
            for key, reasons in sorted(held.items())
            for why, err in sorted(reasons.items())
        ]
        return "; ".join(parts)
