"""Pages GC cannot delete: dirs below a namespace that GC's user may not write in (a writer
with umask 022 under another uid makes them 0755 or 2755, and the cap then does nothing)."""

from __future__ import annotations

import functools
import grp
import os
import pwd
import re
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from cachemgr.backends import FileFormat, FileKind
from cachemgr.doctor.finding import Finding
from cachemgr.fs import _dirscan
from cachemgr.fs.dirscan import scan_usage
from cachemgr.fs.leadership import Leadership
from cachemgr.layout import Layout
from cachemgr.ns.manifest import format_of
from cachemgr.ns.quarantine import ns_root_problem
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


# Pages of one namespace whose own flags (chattr) and owner (in a sticky dir) doctor reads; the
# dirs' checks cover every page. At millions of pages, reading each took a minute (bench_cli).
SAMPLE = 10_000


def lint_deletable(layout: Layout, sample: int | None = SAMPLE) -> list[Finding]:
    """An error per namespace holding pages GC's user cannot delete, with the fix; each
    namespace's first `sample` pages (None: all) are checked one by one, and an info finding
    says where some were not."""
    deleter = gc_deleter(layout)
    if deleter is None or ns_root_problem(layout) is not None:  # (said by lint_root)
        return []
    found = []
    for ns_id in sorted(on_disk(layout)[0]):
        stuck = _stuck_pages(layout, ns_id, deleter, sample)
        if stuck.count:
            found.append(_finding(layout, ns_id, deleter, stuck))
        elif stuck.sampled:
            found.append(_sampled(ns_id, stuck))
    return found


@dataclass
class _Stuck:
    """The pages of one namespace GC's user cannot unlink, and one example of each cause."""

    left: int | None  # pages still to check one by one (None: no bound)
    count: int = 0
    checked: int = 0  # pages checked one by one
    sampled: bool = False  # some pages were not: `count` is a lower bound
    mode_dir: Path | None = None  # a dir GC's user may not write in (a writer's umask 022)
    sticky_dir: Path | None = None  # a sticky dir whose owner, and the file's, is another uid
    pinned: Path | None = None  # chattr +i or +a on the page or its dir: refused to everyone

    def take_one(self) -> bool:
        """Whether one more page may be checked one by one (counted if so)."""
        if self.left is not None and self.checked >= self.left:
            self.sampled = True
            return False
        self.checked += 1
        return True


def _stuck_pages(layout: Layout, ns_id: str, deleter: Deleter, sample: int | None) -> _Stuck:
    """The pages of the namespace that sit where `deleter` cannot unlink them. Links are never
    followed (a link in a namespace is GC's to refuse, not ours), and no page is opened (the
    daemon would count the open as a read of it)."""
    fmt = format_of(layout, ns_id)
    top = layout.ns_dir(ns_id)
    stuck = _Stuck(left=sample)
    if fmt.nesting is None:  # a flat format's pages are in the namespace dir only
        _check_dir(stuck, deleter, _Dir(fmt, top, ""), lambda: _flat_pages(layout, ns_id, fmt))
        return stuck
    for here, _dirs, files in os.walk(top, followlinks=False):
        rel = os.path.relpath(here, top)
        d = _Dir(fmt, Path(here), "" if rel == "." else rel)
        _check_dir(stuck, deleter, d, functools.partial(d.count, files))
    return stuck


@dataclass(frozen=True)
class _Dir:
    """One dir of a namespace: where it is, and its path below the namespace dir."""

    fmt: FileFormat
    path: Path
    rel: str

    def pages(self, names: Iterable[str]) -> Iterator[str]:
        """The names among `names` that are pages of the format here."""
        for name in names:
            path = f"{self.rel}/{name}" if self.rel else name
            if self.fmt.classify_path(path) is FileKind.PAGE:
                yield name

    def count(self, names: Iterable[str]) -> int:
        return sum(1 for _ in self.pages(names))


def _flat_pages(layout: Layout, ns_id: str, fmt: FileFormat) -> int:
    usage = scan_usage(layout, f"ns/{ns_id}", fmt)
    return usage.files if usage else 0


def _check_dir(stuck: _Stuck, deleter: Deleter, d: _Dir, count_pages: Callable[[], int]) -> None:
    """Note the pages of `d` GC's user cannot unlink: all of them (`count_pages`) if the dir
    itself stops it, else each page it lists while the sample lasts."""
    try:
        fd = os.open(d.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        dir_st = os.fstat(fd)
        if _dirscan.pinned(fd, ""):
            _note(stuck, "pinned", d.path, count_pages())
        elif not deleter.may_delete_in(dir_st):
            _note(stuck, "mode_dir", d.path, count_pages())
        else:
            _check_pages(stuck, deleter, d, fd, dir_st)
    except OSError:
        return  # gone or replaced while doctor looked
    finally:
        os.close(fd)


def _check_pages(stuck: _Stuck, deleter: Deleter, d: _Dir, fd: int, dir_st: os.stat_result) -> None:
    owners_matter = bool(dir_st.st_mode & stat.S_ISVTX) and deleter.uid not in (0, dir_st.st_uid)
    with os.scandir(fd) as entries:
        for name in d.pages(e.name for e in entries):
            if not stuck.take_one():
                return
            try:
                if _dirscan.pinned(fd, name):
                    _note(stuck, "pinned", d.path, 1)
                elif owners_matter:
                    file_st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    if not deleter.may_unlink(dir_st, file_st):
                        _note(stuck, "sticky_dir", d.path, 1)
            except OSError:
                continue  # deleted since the listing


def _note(stuck: _Stuck, cause: str, here: Path, pages: int) -> None:
    if pages and getattr(stuck, cause) is None:
        setattr(stuck, cause, here)
    stuck.count += pages


def _sampled(ns_id: str, stuck: _Stuck) -> Finding:
    what = (
        f"ns {ns_id}: doctor read the flags and owner of {stuck.checked:,} pages, the first "
        "its dir lists, not all: a page pinned (chattr +i or +a) or another uid's in a sticky "
        "dir among the rest is not counted (the dirs themselves were checked)"
    )
    fix = "`cachemgr doctor --all-pages` reads every page (seconds per million)"
    return Finding("info", "pages-sampled", what, fix)


def _finding(layout: Layout, ns_id: str, deleter: Deleter, stuck: _Stuck) -> Finding:
    ns_dir = layout.ns_dir(ns_id)
    some = f"at least {stuck.count:,}" if stuck.sampled else f"{stuck.count:,}"
    what = f"{some} pages in ns {ns_id} cannot be deleted by uid {deleter.uid} (GC's user)"
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
    if stuck.sampled:
        message += (
            f" (a sample: doctor read the flags and owner of the first {stuck.checked:,} pages "
            "the dir lists; `cachemgr doctor --all-pages` reads every page)"
        )
    return Finding("error", "gc-cannot-delete", message, "; ".join(fixes))


def _group(gid: int) -> str:
    try:
        return f"{gid} ({grp.getgrgid(gid).gr_name})"
    except KeyError:
        return str(gid)
