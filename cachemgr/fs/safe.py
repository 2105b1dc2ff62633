"""Opening directories and files below a base dir (the root, or the state dir) without ever
leaving it: the one primitive every read, write and delete of cachemgr goes through.

Directories are opened component by component from the base with O_NOFOLLOW, and files
relative to that descriptor with O_NOFOLLOW and O_NONBLOCK, then checked with fstat: a symlink
planted anywhere on the way (or swapped in while we work) is refused instead of followed, and a
FIFO or device is refused instead of blocking us for ever. A dir on another mount than the base
(a filesystem or a bind mount put there) is the edge: never entered. A bind mount of a dir on
the same filesystem has the base's st_dev, so the mount id tells it (statx STATX_MNT_ID).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from cachemgr.errors import UnsafePathError
from cachemgr.fs._dirscan import mount_id

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_TEMP_SUFFIX = ".tmp-cachemgr"  # write_atomic_at's temp names: .<name>.<12 hex>.tmp-cachemgr
_OWN_TEMP_RE = re.compile(r"\.[^/\x00]+\.[0-9a-f]{12}" + re.escape(_TEMP_SUFFIX))
# Modes that leave the permissions to the deploy: the process umask takes bits away (UMask=0002
# keeps the group's write, which the daemon needs to delete an engine's pages and the engine's
# `init` to write the state DB), and a setgid parent passes its group and setgid bit on to a
# new dir (the kernel's rule). A fixed 0o755 made every shared-group deploy fail.
DIR_MODE = 0o777
FILE_MODE = 0o666


@contextmanager
def open_dir(
    base: Path, rel: str, *, create: bool = False, any_mount: bool = False
) -> Iterator[int]:
    """A descriptor for <base>/<rel>, refusing '..', absolute parts, symlinks and mount points
    on the way (`any_mount`: a dir on another mount is fine: the state dir, the operator's
    choice).

    `create`: make the missing dirs first, one component at a time, never through a symlink
    (base's own parents are the operator's path, made as they come).
    """
    parts = Path(rel).parts
    if Path(rel).is_absolute() or any(p in ("..", ".") for p in parts):
        raise UnsafePathError(f"{rel!r} is not a plain path below {base}")
    if create:
        base.parent.mkdir(parents=True, exist_ok=True)
        _mkdir(str(base), None)
    fd = _open_nofollow(str(base), None, base)
    try:
        mount = mount_of(fd)
        for i, part in enumerate(parts):
            if create:
                _mkdir(part, fd)
            child = _open_nofollow(part, fd, base / rel)
            os.close(fd)
            fd = child
            if not any_mount and mount_of(fd) != mount:
                where = base.joinpath(*parts[: i + 1])
                raise UnsafePathError(f"{where}: on another mount than {base}; not entered")
        yield fd
    finally:
        os.close(fd)


def mount_of(fd: int) -> tuple[int, int]:
    """(st_dev, mount id) of an open dir: two dirs on one mount have the same."""
    mnt = mount_id(fd) or _fdinfo_mount(fd)
    return os.fstat(fd).st_dev, mnt


def _fdinfo_mount(fd: int) -> int:
    """The mount id /proc says of `fd`, for a kernel whose statx has no STATX_MNT_ID (< 5.8);
    0 if /proc cannot say either (then st_dev alone decides)."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            for line in f:
                if line.startswith("mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def on_other_mount(dir_fd: int, name: str) -> bool:
    """Whether dir `name` in `dir_fd` is a mount point (on another mount than `dir_fd`); False
    if it is not a dir reached without a link (the caller's own checks say what it is)."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        return mount_of(fd) != mount_of(dir_fd)
    finally:
        os.close(fd)


@contextmanager
def open_dir_at(dir_fd: int, name: str) -> Iterator[int]:
    """A descriptor for the dir `name` in `dir_fd`, never through a symlink nor onto another
    mount (the edge of the root, as in open_dir)."""
    fd = _open_nofollow(name, dir_fd, Path(name))
    try:
        if mount_of(fd) != mount_of(dir_fd):
            raise UnsafePathError(f"{name}: on another mount than its parent; not entered")
        yield fd
    finally:
        os.close(fd)


def _mkdir(name: str, dir_fd: int | None) -> None:
    # mkdir never follows a symlink in its last component: one there is EEXIST, and the
    # O_NOFOLLOW open that comes next refuses it.
    with contextlib.suppress(FileExistsError):
        make_dir(name, dir_fd)


def make_dir(name: str, dir_fd: int | None) -> None:
    """mkdir `name` in `dir_fd` with the deploy's permissions (see DIR_MODE)."""
    os.mkdir(name, DIR_MODE, dir_fd=dir_fd)


def _open_nofollow(name: str, dir_fd: int | None, shown: Path) -> int:
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePathError(f"{shown}: a symlink or non-directory on the way") from e
        raise


def open_regular(dir_fd: int, name: str, flags: int, mode: int = FILE_MODE) -> int:
    """Open `name` in `dir_fd` only if it is (or is created as) a regular file; never follows a
    symlink, never blocks on a FIFO, never opens for writing a file with other hard links
    (O_TRUNC is refused: it would act before the checks). UnsafePathError for anything else."""
    if flags & os.O_TRUNC:
        raise ValueError("open_regular: O_TRUNC would truncate before the checks")
    if os.sep in name or name in ("", ".", ".."):
        raise UnsafePathError(f"{name!r} is not a plain file name")
    try:
        fd = os.open(name, flags | _FILE_FLAGS, mode, dir_fd=dir_fd)
    except OSError as e:
        # ELOOP: a symlink; ENXIO: a FIFO with no reader (write side); EISDIR, ENOTDIR.
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENOTDIR):
            raise UnsafePathError(f"{name}: a symlink or not a regular file; left alone") from e
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafePathError(f"{name}: not a regular file; left alone")
    if flags & (os.O_WRONLY | os.O_RDWR) and st.st_nlink > 1:
        # A hard link planted at our name shares its inode with a file elsewhere: writing
        # (a lock note, the reserve's fallocate) would change that file. Ours never have two.
        os.close(fd)
        raise UnsafePathError(f"{name}: has {st.st_nlink} hard links; cachemgr does not write it")
    return fd


def open_file(path: Path, flags: int, mode: int = FILE_MODE) -> int:
    """open_regular() of `path` in its dir, which is opened without following a symlink (and
    made, with O_CREAT): for the state dir's files, whose dir a person could replace by a link."""
    with open_dir(path.parent, "", create=bool(flags & os.O_CREAT)) as dir_fd:
        try:
            return open_regular(dir_fd, path.name, flags, mode)
        except UnsafePathError as e:
            raise UnsafePathError(
                f"{path.parent}/{e} (move it away, or point --state-dir elsewhere)"
            ) from e


def refuse_non_regular(paths: Iterable[Path]) -> None:
    """UnsafePathError if any of `paths` exists as anything but a regular file with one link (a
    symlink, a hard link, a FIFO, a dir): for files another library opens by path (SQLite),
    which we cannot make refuse links itself. Each path's dir is opened (made if absent)
    without following links."""
    for path in paths:
        with open_dir(path.parent, "", create=True) as dir_fd:
            try:
                st = os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            raise UnsafePathError(
                f"{path} is a symlink, a hard link or not a regular file; cachemgr does not "
                "open it (move it away, or point --state-dir elsewhere)"
            )


def read_regular(dir_fd: int, name: str, limit: int) -> bytes:
    """The bytes of regular file `name` in `dir_fd`; UnsafePathError if it is not one or is
    larger than `limit` bytes (it is never read past the limit)."""
    fd = open_regular(dir_fd, name, os.O_RDONLY)
    try:
        raw = b""
        while len(raw) <= limit:  # one byte past the limit is enough to refuse it
            chunk = os.read(fd, limit + 1 - len(raw))
            if not chunk:
                break
            raw += chunk
    finally:
        os.close(fd)
    if len(raw) > limit:
        raise UnsafePathError(f"{name}: larger than {limit} bytes; left alone")
    return raw


def write_atomic_at(
    dir_fd: int, name: str, data: bytes | Iterable[memoryview], *, mode: int = FILE_MODE
) -> None:
    """Replace `name` in `dir_fd` with `data` (or these buffers, one after the other: no copy
    of them all), atomically and durably: a temp file in the same dir, fsync, rename (which
    replaces a planted symlink itself, never its target), fsync dir."""
    tmp = f".{name}.{secrets.token_hex(6)}{_TEMP_SUFFIX}"
    fd = open_regular(dir_fd, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            for chunk in [data] if isinstance(data, bytes) else data:
                view = memoryview(chunk).cast("B")
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        # Our own temp file, never a page: the one unlink that is not deletion.py's.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)


def is_own_temp(name: str) -> bool:
    """Whether `name` is a temp file write_atomic_at left behind (a kill -9 mid-write): exactly
    its shape, so that GC, which deletes these, never takes a look-alike."""
    return _OWN_TEMP_RE.fullmatch(name) is not None
