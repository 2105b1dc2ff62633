"""Which filesystem a path is on, by statfs's f_type: SQLite's locking is unsafe over a network
filesystem (and a FUSE one may be anything), so fleet mode keeps the state DB off them."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from cachemgr.errors import ConfigError

# <linux/magic.h> and the filesystems' own headers
NETWORK_FS = {
    0x6969: "nfs",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x517B: "smb",
    0x00C36400: "ceph",
    0x65735546: "fuse",
    0x0BD00BD0: "lustre",
    0x01161970: "gfs2",
    0x7461636F: "ocfs2",
    0x01021997: "9p",
    0x5346414F: "afs",
    0x6B414653: "afs",
    0x47504653: "gpfs",
    0x013111A8: "ibrix",
    0xAAD7AAEA: "panfs",
}
_libc = ctypes.CDLL(None, use_errno=True)
_STATFS_SIZE = 120  # struct statfs on 64-bit Linux; f_type is its first word


def fs_type(path: Path) -> int:
    """statfs(2)'s f_type for `path`."""
    buf = ctypes.create_string_buffer(_STATFS_SIZE)
    if _libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return int.from_bytes(buf.raw[: ctypes.sizeof(ctypes.c_long)], "little") & 0xFFFFFFFF


def existing_ancestor(path: Path) -> Path:
    """`path` or the nearest dir above it that exists (what it will be created on)."""
    path = path.absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def refuse_network_fs(state_dir: Path) -> None:
    """ConfigError if the state dir is (or would be made) on a network or FUSE filesystem."""
    kind = NETWORK_FS.get(fs_type(existing_ancestor(state_dir)))
    if kind is not None:
        raise ConfigError(
            f"state dir {state_dir} is on {kind}: in fleet mode the state DB must be "
            "node-local (set state_dir, env CACHEMGR_STATE_DIR, to a local disk)"
        )
