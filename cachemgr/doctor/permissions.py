"""Pages GC cannot delete: dirs below a namespace that GC's user may not write in (a writer
with umask 022 under another uid makes them 0755 or 2755, and the cap then does nothing)."""

from __future__ import annotations

import fcntl
import grp
import os
import pwd
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from cachemgr.backends import FileKind
from cachemgr.doctor.finding import Finding
from cachemgr.fs.leadership import Leadership
from cachemgr.layout import Layout
from cachemgr.ns.manifest import format_of
from cachemgr.ns.registry import on_disk

_UID_RE = re.compile(r"\buid (\d+)\b")
_FS_IOC_GETFLAGS = 0x80086601  # linux/fs.h _IOR('f', 1, long): the chattr flags
_PINNING_FLAGS = 0x10 | 0x20  # FS_IMMUTABLE_FL, FS_APPEND_FL


@dataclass(frozen=True)
class Deleter:
    """Who deletes for GC: its uid and groups."""

    uid: int
    groups: frozenset[int]

    def may_delete_in(self, st: os.stat_result) -> bool:
        """Whether unlinking in a dir of this stat is allowed (write and search on it)."""
        if self.uid == 0:
            return True
        if st.st_uid == self.uid:
            bits = st.st_mode >> 6
        elif st.st_gid in self.groups:
            bits = st.st_mode >> 3
        else:
            bits = st.st_mode
        return bits & 0o3 == 0o3

    def may_unlink(self, dir_st: os.stat_result, file_st: os.stat_result) -> bool:
        """A sticky dir (chmod +t) lets only the file's or the dir's owner unlink."""
        if not self.may_delete_in(dir_st):
            return False
        sticky = bool(dir_st.st_mode & stat.S_ISVTX) and self.uid != 0
        return not sticky or self.uid in (dir_st.st_uid, file_st.st_uid)


def gc_deleter(layout: Layout) -> Deleter | None:
    """GC's user: the uid the GC leader wrote in the lock file (else the file's owner), with
    its groups (from the user database; a container's uid has none there, so the groups of the
    lock file and of the root, which an fsGroup or a setgid root gives it)."""
    try:
        lock_st = os.stat(layout.gc_lock, follow_symlinks=False)
        root_st = os.stat(layout.root)
    except OSError:
        return None  # no GC ever ran here
    m = _UID_RE.search(Leadership(layout.gc_lock).holder() or "")
    uid = int(m.group(1)) if m else lock_st.st_uid
    groups = {lock_st.st_gid, root_st.st_gid}
    try:
        user = pwd.getpwuid(uid)
        groups.update(os.getgrouplist(user.pw_name, user.pw_gid))
    except KeyError:
        pass
    return Deleter(uid, frozenset(groups))


def lint_deletable(layout: Layout) -> list[Finding]:
    """An error per namespace holding pages GC's user cannot delete, with the fix."""
    deleter = gc_deleter(layout)
    if deleter is None:
        return []
    found = []
    for ns_id in sorted(on_disk(layout)[0]):
        stuck = _stuck_pages(layout, ns_id, deleter)
        if stuck.count:
            found.append(_finding(layout, ns_id, deleter, stuck))
    return found


@dataclass
class _Stuck:
    """The pages of one namespace GC's user cannot unlink, and one example of each cause."""

    count: int = 0
    mode_dir: Path | None = None  # a dir GC's user may not write in (a writer's umask 022)
    sticky_dir: Path | None = None  # a sticky dir whose owner, and the file's, is another uid
    pinned: Path | None = None  # chattr +i or +a on the page or its dir: refused to everyone


def _stuck_pages(layout: Layout, ns_id: str, deleter: Deleter) -> _Stuck:
    """The pages of the namespace that sit where `deleter` cannot unlink them. Links are never
    followed (a link in a namespace is GC's to refuse, not ours)."""
    fmt = format_of(layout, ns_id)
    top = layout.ns_dir(ns_id)
    stuck = _Stuck()
    for here, dirs, files in os.walk(top, followlinks=False):
        if fmt.nesting is None:
            dirs.clear()  # a flat format's pages are in the namespace dir only
        try:
            dir_st = os.stat(here, follow_symlinks=False)
        except OSError:
            continue
        rel = os.path.relpath(here, top)
        dir_pinned = _pinned(here)
        for name in files:
            path = name if rel == "." else f"{rel}/{name}"
            if fmt.classify_path(path) is not FileKind.PAGE:
                continue
            file = os.path.join(here, name)
            try:
                file_st = os.stat(file, follow_symlinks=False)
            except OSError:
                continue
            _note(stuck, deleter, Path(here), dir_st, file_st, dir_pinned or _pinned(file))
    return stuck


def _note(
    stuck: _Stuck,
    deleter: Deleter,
    here: Path,
    dir_st: os.stat_result,
    file_st: os.stat_result,
    pinned: bool,
) -> None:
    if pinned:
        stuck.pinned = stuck.pinned or here
    elif not deleter.may_delete_in(dir_st):
        stuck.mode_dir = stuck.mode_dir or here
    elif not deleter.may_unlink(dir_st, file_st):
        stuck.sticky_dir = stuck.sticky_dir or here
    else:
        return
    stuck.count += 1


def _pinned(path: str) -> bool:
    """Whether chattr +i or +a is set on `path`: then no one unlinks it (or in it), root
    included, and no mode bit says so. False where the flags cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        flags = fcntl.ioctl(fd, _FS_IOC_GETFLAGS, bytes(8))
    except OSError:
        return False  # a file system without these flags
    finally:
        os.close(fd)
    return bool(int.from_bytes(flags[:4], sys.byteorder) & _PINNING_FLAGS)


def _finding(layout: Layout, ns_id: str, deleter: Deleter, stuck: _Stuck) -> Finding:
    ns_dir = layout.ns_dir(ns_id)
    what = f"{stuck.count:,} pages in ns {ns_id} cannot be deleted by uid {deleter.uid} (GC's user)"
    causes, fixes = [], []
    if stuck.pinned is not None:
        causes.append(f"pages in {stuck.pinned} (or the dir) are immutable or append-only")
        fixes.append(f"`lsattr -R {ns_dir}` shows them; `chattr -i -a` each (as root)")
    if stuck.sticky_dir is not None:
        st = os.stat(stuck.sticky_dir, follow_symlinks=False)
        causes.append(
            f"{stuck.sticky_dir} is a sticky dir (mode {stat.S_IMODE(st.st_mode):o}) of uid "
            f"{st.st_uid}: only a page's owner or the dir's may unlink it"
        )
        fixes.append(f"`chmod -t {stuck.sticky_dir}`")
    if stuck.mode_dir is not None:
        st = os.stat(stuck.mode_dir, follow_symlinks=False)
        causes.append(
            f"{stuck.mode_dir} is mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid}, gid "
            f"{_group(st.st_gid)}, without the group's write: the writer's umask is 022"
        )
        fixes.append(
            f"run the engine with umask 0002 and in group {_group(st.st_gid)} (systemd "
            "UMask=0002; in a container `umask 0002 && exec …`, see docs/deploy.md), then once "
            f"`chmod -R g+w {ns_dir}`"
        )
    message = f"{what}: {'; '.join(causes)}, so GC cannot keep the cap"
    return Finding("error", "gc-cannot-delete", message, "; ".join(fixes))


def _group(gid: int) -> str:
    try:
        return f"{gid} ({grp.getgrgid(gid).gr_name})"
    except KeyError:
        return str(gid)
