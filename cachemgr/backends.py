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
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class FileKind(enum.IntEnum):
    """What a directory entry's name says it is. Only PAGE and TEMP may ever be deleted."""

    FOREIGN = 0
    PAGE = 1
    TEMP = 2


@dataclass(frozen=True)
class ScanRules:
    """How the C scanner folds names into *shapes*, so Python classifies each shape once.

    A name's shape replaces its key (a leading run of `key_min`..`key_max` hex digits) by
    zeros, or, for a name that is `temp_lead` then exactly `temp_hex` hex digits, those
    digits: all pages of one kind share a shape, and so do such temps. The format's patterns
    must give a shape the verdict they give each of its names (tests/test_dirscan.py checks).
    """

    key_min: int
    key_max: int
    temp_lead: str  # one character
    temp_hex: int


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

    def classify(self, name: str) -> FileKind:
        """What `name` is. Pages first: nearly every name is one, and the patterns are disjoint."""
        if self.page.fullmatch(name):
            return FileKind.PAGE
        if self.temp.fullmatch(name):
            return FileKind.TEMP
        return FileKind.FOREIGN

    def key_len(self, name: str) -> int | None:
        """The length of a page file's key, the prefix it shares with every file of its page;
        None if `name` is not a page file."""
        m = self.page.fullmatch(name)
        return None if m is None else m.end("key")

    def maybe_temp(self, name: str) -> bool:
        """False only for names that cannot be temps: the cheap filter before `classify`."""
        return not name.endswith(self.page_suffix)
