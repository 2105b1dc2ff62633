"""Swap two names in one step: renameat2(2) with RENAME_EXCHANGE.

A purge of a bound namespace puts an empty dir in its place. Done as two renames (the old dir
out, the empty one in), a kill -9 between them left `ns/<id>` absent: the running server had
no storage dir until its next init, and nothing said so. The exchange leaves no such moment.
"""

from __future__ import annotations

import ctypes
import errno
import os

RENAME_EXCHANGE = 2  # <linux/fs.h>
# What says the kernel, the C library or the filesystem cannot exchange (NFS: EINVAL).
UNSUPPORTED = frozenset({errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP})

_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)  # glibc 2.28 and later
if _renameat2 is not None:
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    _renameat2.argtypes += [ctypes.c_uint]
    _renameat2.restype = ctypes.c_int


def exchange(dir_a: int, name_a: str, dir_b: int, name_b: str) -> bool:
    """Swap `name_a` in `dir_a` with `name_b` in `dir_b` at once (neither symlink is followed:
    names are swapped, not what they point to). False where this kernel, C library or
    filesystem cannot, and nothing moved; OSError for any other refusal."""
    if _renameat2 is None:
        return False
    a, b = os.fsencode(name_a), os.fsencode(name_b)
    if _renameat2(dir_a, a, dir_b, b, RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), name_b)
