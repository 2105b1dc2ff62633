"""Creating a cache root's skeleton (the names and paths are cachemgr.layout's)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from pathlib import Path

from cachemgr.errors import ConfigError, UnsafePathError
from cachemgr.fs.safe import open_dir, open_file, write_atomic_at
from cachemgr.layout import CACHEDIR_TAG, NS_DIR, TAG_FILE, TRASH_DIR, Layout

log = logging.getLogger(__name__)
WRITE_REFUSED = (errno.EROFS, errno.EACCES, errno.EPERM)  # the errors `unwritable` explains


def create_root(layout: Layout) -> None:
    """Create the skeleton (idempotent), never through a symlink: one planted at a dir is
    an UnsafePathError; an unusable root is a ConfigError."""
    state = _relative(layout.state_dir, layout.root)
    target = layout.root
    try:
        for base, rel in ((layout.root, NS_DIR), state):
            target = base / rel
            # the state dir may be a mount of its own (the DB off the cache's disk)
            with open_dir(base, rel, create=True, any_mount=rel != NS_DIR):
                pass
            why = unwritable(target)
            if why:
                raise ConfigError(f"cannot use root {layout.root}: {why}")
        # A planted .trash/ only stops purges (which report it) and GC's trash step: the
        # rest of the root stays usable, so it is not a reason to refuse the root.
        try:
            with open_dir(layout.root, TRASH_DIR, create=True):
                pass
        except UnsafePathError as e:
            log.warning("trash left alone: %s", e)
        target = layout.root
        _tag(layout.root)
        _gc_lock_file(layout)
    except OSError as e:
        why = unwritable(target) if e.errno in WRITE_REFUSED else None
        raise ConfigError(f"cannot use root {layout.root}: {why or e.strerror or e}") from e


def _gc_lock_file(layout: Layout) -> None:
    """Make the GC lock's file now: on a filesystem with no inode left, leading GC (which
    frees inodes) must need none (a planted link is refused when GC leads)."""
    with contextlib.suppress(OSError, UnsafePathError):
        os.close(open_file(layout.gc_lock, os.O_RDWR | os.O_CREAT))


def unwritable(path: Path) -> str | None:
    """Why this user cannot create files in `path` (or in its nearest existing ancestor): a
    read-only filesystem, or the permissions; None if it can. Root passes every permission
    check, so only the read-only case can explain a refusal to root."""
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return f"{path} is on a read-only filesystem"
    except OSError:
        pass  # unreadable: the access check below says so
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable by this user (uid {os.getuid()})"
    return None


def _tag(root: Path) -> None:
    """Write CACHEDIR.TAG unless something (even a dangling link) has that name already."""
    with open_dir(root, "") as fd:
        try:
            os.stat(TAG_FILE, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            write_atomic_at(fd, TAG_FILE, CACHEDIR_TAG.encode("ascii"))


def _relative(path: Path, base: Path) -> tuple[Path, str]:
    """(base, rel) to open `path` from: from `base` when it lies inside, so that a symlink at
    any component below `base` is refused; else from its own parent (the operator's path)."""
    if path.is_relative_to(base) and path != base:
        return base, str(path.relative_to(base))
    return path.parent, path.name
