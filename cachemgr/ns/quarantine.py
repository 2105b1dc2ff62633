"""Namespaces the daemon cannot use, held aside instead of failing a scan or a GC cycle.

A namespace dir another user made (0755: readable, its pages not deletable), one the daemon
cannot read (0700 of another owner, `chmod 000`), or a root that became unreadable, is
outside the daemon's control. The index and GC skip it and go on with the others; each entry
is logged once when found and once when it is usable again, shown in
`cachemgr_namespace_unusable{namespace,reason}` / `cachemgr_root_unusable`, in /readyz's
detail, and by doctor (cachemgr.doctor.root). Whoever finds it usable again clears it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Literal

from cachemgr.fs.deletecheck import DENIED

log = logging.getLogger(__name__)
Reason = Literal["unreadable", "not-writable"]
ROOT = ""  # the key of the root itself (its ns/ dir cannot be listed)


def is_denied(error: BaseException) -> bool:
    """Whether `error` is the kernel refusing access (mode bits, an ACL, a foreign owner)."""
    return isinstance(error, OSError) and error.errno in DENIED


@dataclass
class Quarantine:
    """What is held aside now: key (a namespace id, or ROOT) -> (reason, the error seen)."""

    _held: dict[str, tuple[Reason, str]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def mark(self, key: str, reason: Reason, error: BaseException | str) -> None:
        """Hold `key` aside; logged only when it was not held for this reason already."""
        with self._lock:
            new = self._held.get(key, (None, ""))[0] != reason
            self._held[key] = (reason, str(error))
        if new and key == ROOT:
            log.error(
                "root unusable; the daemon waits for it",
                extra={"reason": reason, "error": str(error)},
            )
        elif new:
            log.warning(
                "namespace unusable; skipped",
                extra={"namespace": key, "reason": reason, "error": str(error)},
            )

    def clear(self, key: str, reason: Reason) -> None:
        """`key` was just used for what `reason` says it could not be: usable again."""
        with self._lock:
            held = self._held.get(key)
            if held is None or held[0] != reason:
                return
            del self._held[key]
        what = "root" if key == ROOT else "namespace"
        log.warning(f"{what} usable again", extra={"namespace": key, "reason": reason})

    def held(self) -> dict[str, tuple[Reason, str]]:
        with self._lock:
            return dict(self._held)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._held

    def degraded(self) -> str | None:
        """What /readyz says while anything is held aside, else None."""
        held = self.held()
        if not held:
            return None
        parts = [
            f"root {why}: {err}" if key == ROOT else f"namespace {key} {why}"
            for key, (why, err) in sorted(held.items())
        ]
        return "; ".join(parts)
