"""Page files with another hard link (st_nlink > 1: an operator's `cp -al` backup of the cache
on its filesystem): GC deletes them and frees nothing, so a cap or floor it says unmet stays
so (cachemgr.gc.step.HARD_LINKS). Doctor stats a sample of each namespace's pages, not all:
a namespace dir may hold millions, and a backup links every page it copied."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from cachemgr.doctor.finding import Finding
from cachemgr.fs.dirscan import PAGES, list_files
from cachemgr.gc.step import HARD_LINKS
from cachemgr.layout import Layout
from cachemgr.ns.manifest import format_of
from cachemgr.state.index import namespace_dirs

# Page files doctor stats in each namespace: the first ones its listing returns, a few
# getdents batches of a dir of any size (no full walk: a dir may hold millions).
SAMPLE = 1_000


@dataclass(frozen=True)
class Linked:
    """A namespace's sample: page files statted, how many had another link, one of those."""

    ns_id: str
    sampled: int
    linked: int
    example: Path


def lint_hard_links(layout: Layout, sample: int = SAMPLE) -> list[Finding]:
    """A warning for each namespace whose sampled page files have other hard links."""
    return [_finding(layout, found) for found in _linked(layout, sample)]


def _linked(layout: Layout, sample: int) -> Iterator[Linked]:
    try:
        dirs = namespace_dirs(layout)
    except OSError:  # ns/ unusable: lint_root says so
        return
    for ns_id in dirs:
        try:  # (the pages GC would list: through vouched dirs of the format, on the mount)
            with closing(list_files(layout, f"ns/{ns_id}", PAGES, format_of(layout, ns_id))) as it:
                statted = list(itertools.islice(it, sample))
        except OSError:  # a dir this user may not read: the permission checks say so
            continue
        linked = [f.name for f in statted if f.links > 1]
        if linked:
            yield Linked(ns_id, len(statted), len(linked), layout.ns_dir(ns_id) / linked[0])


def _finding(layout: Layout, found: Linked) -> Finding:
    what = (
        f"ns {found.ns_id}: {found.linked:,} of the {found.sampled:,} page files doctor "
        f"sampled are {HARD_LINKS}, e.g. {found.example}: GC deletes them and frees neither "
        "their bytes nor their inodes, so a cap or the free-space floor can stay unmet"
    )
    fix = (
        f"remove the other links (`find {_mount_of(layout.root)} -xdev -samefile "
        f"{found.example}` lists them): delete that backup, or move it to another filesystem"
    )
    return Finding("warning", "hard-linked-pages", what, fix)


def _mount_of(path: Path) -> Path:
    """The mount point of the filesystem `path` is on (where the other links can be)."""
    dev = path.stat().st_dev
    while path.parent != path and path.parent.stat().st_dev == dev:
        path = path.parent
    return path
