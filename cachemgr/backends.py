"""What an engine's on-disk cache format looks like to cachemgr: one small description per format.

Everything that knows how a storage backend names its files (which names are pages, which are a
write in progress, which files make up one logical page) reads it from a `FileFormat`; the rest
of cachemgr only scans, indexes and deletes. SGLang's HiCacheFile is `cachemgr.sglang.hicache`;
a second engine's format is one more instance of this type beside it.

Every format shares two conventions the C scanner (cachemgr.fs._dirscan) and the page index
build on:

* a page file's name starts with its *key*: a run of lowercase hex digits (the page hash);
* every file of one logical page shares that key, and only those do (extra memory pools, tensor-
  parallel ranks: a page is usable only while all of them are on disk), so the page is the group
  of files with one key: it is counted once and evicted whole.

A format whose page files sit in subdirectories of the namespace dir (vLLM's hashed dirs) says
so in its `Nesting`: the dir names of each level and which top-level dirs are the engine's own.
Such a page is then named by its path below the namespace dir ("a_r0/0f3/a1_g0/<hash>.bin");
its key is that whole path: one file is one page, and the dirs are part of its name.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class FileKind(enum.IntEnum):
    """What a directory entry's name says it is. Only PAGE and TEMP may ever be deleted."""

    FOREIGN = 0
    PAGE = 1
    TEMP = 2


@dataclass(frozen=True)
class ScanRules:
    """How the C scanner folds names into *shapes*, so Python classifies each shape once.

    A name's shape replaces its key (a leading run of `key_min`..`key_max` hex digits) by as
    many zeros, or, for a name that is `temp_lead` then exactly `temp_hex` hex digits, those
    digits: all pages of one kind share a shape, and so do such temps. The format's patterns
    must give a shape the verdict they give each of its names (tests/test_dirscan.py checks).
    """

    key_min: int
    key_max: int
    temp_lead: str  # one character
    temp_hex: int


@dataclass(frozen=True)
class Nesting:
    """The dirs between a namespace dir and the page files: one name pattern per level.

    A top-level dir is the engine's only if an identity file vouches for it: `owner` names the
    sibling dir that holds `identity_file` for a top-level dir name, and `vouches(owner, bytes)`
    says whether that file's content is the one that names `owner`. Anything else (a dir a
    person made, one whose identity file is missing, partial or another's) is foreign: nothing
    in it is counted as a page or ever deleted.
    """

    levels: tuple[re.Pattern[str], ...]
    owner: Callable[[str], str]
    identity_file: str
    vouches: Callable[[str, bytes], bool]

    def dir_ok(self, level: int, name: str) -> bool:
        """Whether a dir name fits `level` (the top level's vouching is the caller's)."""
        return self.levels[level].fullmatch(name) is not None


@dataclass(frozen=True)
class FileFormat:
    """One engine's naming of the files in a storage directory."""

    name: str  # for people: "SGLang HiCacheFile"
    page: re.Pattern[str]  # a page file's whole name; its group `key` is the page's key
    temp: re.Pattern[str]  # a temp file's whole name: a write in progress or its leftover
    # Every page name ends with it and no temp name does: a sweep for temps skips the pages of
    # a million-name dir without a regex per name (that held the GIL ~1.5 s).
    page_suffix: str
    scan: ScanRules
    nesting: Nesting | None = None  # None: the page files sit in the namespace dir itself
    # Whether a page stored right after another of its stream most likely continues it: the
    # chain model's first guess of a predecessor (cachemgr.gc.chains). True for SGLang.
    write_order: bool = True
    # The environment variable the server reads its storage dir from (None: its command says
    # it): a live process whose environment sets it to a namespace dir still writes there.
    dir_env: str | None = None
    # The storage dirs a server's arguments name, as written (a relative one is from the
    # server's own working dir): a live process whose arguments name a namespace dir still
    # writes there.
    argv_dirs: Callable[[Sequence[str]], list[str]] | None = None

    def split(self, path: str) -> tuple[str, str] | None:
        """(dirs, file name) of a path below a namespace dir whose dirs fit the nesting (each
        level's pattern, nothing more, nothing less); None for any other path."""
        dirs, _, name = path.rpartition("/")
        parts = dirs.split("/") if dirs else []
        levels = self.nesting.levels if self.nesting else ()
        if len(parts) != len(levels) or not all(map(re.Pattern.fullmatch, levels, parts)):
            return None
        return dirs, name

    def classify_path(self, path: str) -> FileKind:
        """What a path below a namespace dir is: its name's kind if its dirs fit the nesting."""
        where = self.split(path)
        return FileKind.FOREIGN if where is None else self.classify(where[1])

    def classify(self, name: str) -> FileKind:
        """What `name` is. Pages first: nearly every name is one, and the patterns are disjoint."""
        if self.page.fullmatch(name):
            return FileKind.PAGE
        if self.temp.fullmatch(name):
            return FileKind.TEMP
        return FileKind.FOREIGN

    def key_len(self, name: str) -> int | None:
        """The length of a page file's key, the prefix it shares with every file of its page;
        None if `name` is not a page file.

        Parsed by its shape (ScanRules), as the scanner does: the page pattern's verdict on a
        shape is its names' (a key is a run of hex digits, whichever digits), and a namespace's
        millions of names have a handful of shapes. GC parses each victim's name twice (its
        deletion's check, the model's forget): 4.8 us a victim by fullmatch, 2.5 by shape
        (bench/RESULTS.md, session 32)."""
        run = _hex_run(name)
        if self.scan.key_min <= run <= self.scan.key_max:
            end = _shape_end(self.page.pattern, self.page.flags, run, name[run:])
            if end is None or end == run:  # (another end: a key that is not the run, parsed
                return end  # from the name itself; no format's)
        return _key_end(self.page, name)

    def maybe_temp(self, name: str) -> bool:
        """False only for names that cannot be temps: the cheap filter before `classify`."""
        return not name.endswith(self.page_suffix)


_HEX_RUN = re.compile("[0-9a-f]*")  # a key's digits (the scanner's too: _dirscan.c)


def _hex_run(name: str) -> int:
    """The length of the run of hex digits `name` starts with."""
    m = _HEX_RUN.match(name)
    return m.end() if m else 0  # (it always matches, maybe nothing)


# Keyed by the pattern's text, not the compiled pattern: a re.Pattern's hash is computed from
# its code at every call (~1 us, most of a hit's cost); re.compile finds it again in re's cache.
@functools.lru_cache(maxsize=1 << 12)
def _shape_end(pattern: str, flags: int, run: int, rest: str) -> int | None:
    """_key_end of the shape of the names that are `run` hex digits then `rest`: one of the
    handful a namespace's millions of names have."""
    return _key_end(re.compile(pattern, flags), "0" * run + rest)


def _key_end(page: re.Pattern[str], name: str) -> int | None:
    m = page.fullmatch(name)
    return None if m is None else m.end("key")
