"""The daemon's memory between bursts of short-lived objects, and the garbage collector's pauses.

glibc's malloc keeps memory freed at the top of its heap once large blocks have been freed
(its trim threshold rises with them, up to 64 MiB), so after loading a million-page
namespace into the chain model (a few objects per row, all freed) the daemon's RSS stayed
~40 MiB above what it holds; a GC run that plans and deletes many pages leaves the same.
`trim` (`malloc_trim(0)`) returns it (bench/RESULTS.md). Elsewhere (musl, macOS) it is a no-op.

Python's cyclic garbage collector, on its full collections, traverses every object it tracks
in one C call that holds the GIL: in an idle daemon, ~76,000 objects (its modules, classes,
the app), 40 ms of CPU on the development VM and several times that in wall time on a loaded
machine, while /metrics waits. A mass eviction or a burst of events triggers several. What
exists once the daemon has started lives as long as it does: `exempt_startup` moves it out of
those collections' way (`gc.freeze`), so they traverse only what came after.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


def _malloc_trim() -> ctypes._NamedFuncPointer | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def trim() -> None:
    """Return free heap memory to the system (a ms or less; ctypes releases the GIL)."""
    if _TRIM is not None:
        _TRIM(0)


def exempt_startup() -> None:
    """Exempt every object there is from later collections. They are still freed when nothing
    refers to them; only cycles among them that are (or become) garbage stay until `release`
    (none worth a collection: start-up garbage is small; one `gc.collect()` here would cost as
    much as the pause it saves, in a test process that starts hundreds of daemons)."""
    gc.freeze()


def release() -> None:
    """Give the frozen objects back to the collector (the daemon stops: in a process that
    goes on, as a test's, what the daemon left in cycles is collected again)."""
    gc.unfreeze()
