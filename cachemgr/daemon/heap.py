"""The daemon's memory between bursts of short-lived objects, and how long its HTTP thread
waits for the GIL.

glibc's malloc keeps memory freed at the top of its heap once large blocks have been freed
(its trim threshold rises with them, up to 64 MiB), so after loading a million-page
namespace into the chain model (a few objects per row, all freed) the daemon's RSS stayed
~40 MiB above what it holds; a GC run's plan leaves a few MiB too (the daemon trims after
each run). `trim` (`malloc_trim(0)`) returns it (bench/RESULTS.md). Elsewhere (musl, macOS) it
is a no-op.

`malloc_trim` gives back free pages inside every arena, but the free memory at the top of a
thread's arena (not the main one) only goes when a free there leaves more than the trim
threshold on top, and that threshold rises with each large block freed: the index thread's
start-up scan and model load left ~15 MiB there at a million pages that no trim returned.
A serving daemon holds the threshold at glibc's default, 128 KiB (`mallopt`, which also holds
the threshold above which a block is mapped on its own at its default, 128 KiB, instead of
letting it rise too): the arena's top goes back as it is freed.

Python's cyclic garbage collector, on its full collections, traverses every object it tracks
in one C call that holds the GIL: in an idle daemon, ~76,000 objects (its modules, classes,
the app), ~40 ms of CPU on the development VM and several times that in wall time on a loaded
machine, while /metrics waits. A mass eviction or a burst of events triggers several. What
exists once the daemon has started lives as long as it does: `start_serving` moves it out of
those collections' way (`gc.freeze`), so they traverse only what came after.

A thread that wants the GIL while another runs Python waits for the switch interval (5 ms by
default) at each handover, and a scrape needs several (the request read, the response written);
while GC plans or the index applies a mass of events, that was most of a scrape's time. The
daemon asks for 1 ms (`start_serving`): /metrics p99 during a 250,000-page eviction fell by
about a third in bench/RESULTS.md, for a handover a ms to the threads that run Python.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
import threading


def _libc(name: str) -> ctypes._NamedFuncPointer | None:
    """glibc's function `name`, or None (another C library)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc[name]
    except (OSError, AttributeError):
        return None


_TRIM = _libc("malloc_trim")
_MALLOPT = _libc("mallopt")
M_TRIM_THRESHOLD = -1  # mallopt's parameter (malloc.h)
TRIM_THRESHOLD = 128 * 1024  # bytes: glibc's default, held


def trim() -> None:
    """Return free heap memory to the system (a ms or less; ctypes releases the GIL)."""
    if _TRIM is not None:
        _TRIM(0)


SWITCH_INTERVAL = 0.001  # seconds a thread runs Python before a waiting one gets the GIL
_serving = [0, sys.getswitchinterval()]  # daemons serving in this process; the interval before
_lock = threading.Lock()


def start_serving() -> None:
    """Exempt every object there is from later collections, hand the GIL over sooner, and
    hold malloc's trim threshold (for good: glibc cannot be told to let it slide again).
    The objects are still freed when nothing refers to them; only cycles among them that are
    (or become) garbage stay until `stop_serving` (start-up garbage is small: a `gc.collect()`
    first would add its own pause to every start, and a test process starts hundreds)."""
    if _MALLOPT is not None:
        _MALLOPT(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    with _lock:
        if not _serving[0]:
            _serving[1] = sys.getswitchinterval()
        _serving[0] += 1
        gc.freeze()
        sys.setswitchinterval(SWITCH_INTERVAL)


def stop_serving() -> None:
    """Undo `start_serving` once the last daemon of the process stops (in a process that goes
    on, as a test's, what the daemons left in cycles is collected again); one still serving
    keeps both."""
    with _lock:
        _serving[0] = max(_serving[0] - 1, 0)
        if not _serving[0]:
            gc.unfreeze()
            sys.setswitchinterval(_serving[1])
