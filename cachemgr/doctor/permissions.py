"""Pages GC cannot delete: dirs below a namespace that GC's user may not write in (a writer
with umask 022 under another uid makes them 0755 or 2755, and the cap then does nothing)."""

from __future__ import annotations

import grp
import os
import pwd
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from cachemgr.backends import FileKind
from cachemgr.doctor.finding import Finding
from cachemgr.fs.leadership import Leadership
from cachemgr.layout import Layout
from cachemgr.ns.manifest import format_of
from cachemgr.ns.registry import on_disk

_UID_RE = re.compile(r"\buid (\d+)\b")


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
        stuck, example = _stuck_pages(layout, ns_id, deleter)
        if stuck:
            found.append(_finding(layout, ns_id, deleter, stuck, example))
    return found


def _stuck_pages(layout: Layout, ns_id: str, deleter: Deleter) -> tuple[int, Path | None]:
    """How many pages of the namespace sit where `deleter` cannot unlink them, and one such
    dir. Links are never followed (a link in a namespace is GC's to refuse, not ours)."""
    fmt = format_of(layout, ns_id)
    top = layout.ns_dir(ns_id)
    stuck, example = 0, None
    for here, dirs, files in os.walk(top, followlinks=False):
        if fmt.nesting is None:
            dirs.clear()  # a flat format's pages are in the namespace dir only
        try:
            dir_st = os.stat(here, follow_symlinks=False)
        except OSError:
            continue
        rel = os.path.relpath(here, top)
        for name in files:
            path = name if rel == "." else f"{rel}/{name}"
            if fmt.classify_path(path) is not FileKind.PAGE:
                continue
            try:
                file_st = os.stat(os.path.join(here, name), follow_symlinks=False)
            except OSError:
                continue
            if not deleter.may_unlink(dir_st, file_st):
                stuck += 1
                example = example or Path(here)
    return stuck, example


def _finding(
    layout: Layout, ns_id: str, deleter: Deleter, stuck: int, example: Path | None
) -> Finding:
    st = os.stat(example or layout.ns_dir(ns_id), follow_symlinks=False)
    mode = stat.S_IMODE(st.st_mode)
    what = (
        f"{stuck:,} pages in ns {ns_id} cannot be deleted by uid {deleter.uid} (GC's user): "
        f"{example} is mode {mode:o}, uid {st.st_uid}, gid {_group(st.st_gid)}, without the "
        "group's write: the writer's umask is 022, so GC cannot keep the cap"
    )
    fix = (
        f"run the engine with umask 0002 and in group {_group(st.st_gid)} (systemd UMask=0002; "
        "in a container `umask 0002 && exec …`, see docs/deploy.md), then once "
        f"`chmod -R g+w {layout.ns_dir(ns_id)}`"
    )
    return Finding("error", "gc-cannot-delete", what, fix)


def _group(gid: int) -> str:
    try:
        return f"{gid} ({grp.getgrgid(gid).gr_name})"
    except KeyError:
        return str(gid)
