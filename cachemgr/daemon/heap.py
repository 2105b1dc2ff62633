"""Give the C heap's free memory back to the system after a burst of short-lived objects.

glibc's malloc keeps memory freed at the top of its heap once large blocks have been freed
(its trim threshold rises with them, up to 64 MiB), so after loading a million-page
namespace into the chain model (a few objects per row, all freed) the daemon's RSS stayed
~40 MiB above what it holds. `malloc_trim(0)` returns it (bench/RESULTS.md). Elsewhere (musl,
macOS) it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util


def _malloc_trim() -> ctypes._NamedFuncPointer | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def trim() -> None:
    """Return free heap memory to the system (a few ms)."""
    if _TRIM is not None:
        _TRIM(0)
