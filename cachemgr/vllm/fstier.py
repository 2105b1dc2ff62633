"""vLLM's file-system KV tier (`TieringOffloadingSpec` with an "fs" secondary tier; the same
layout in 0.33.0 and 0.34.0) as a cachemgr file format (cachemgr.backends). Facts and
sources: docs/vllm-notes.md.

Inside its `root_dir` (a namespace dir) vLLM writes

  <model>_<digest12>/config.json                          the identity file (digest = its fields)
  <model>_<digest12>/.o_direct_probe_<n>.tmp             briefly, at start (vLLM removes it)
  <model>_<digest12>_r<rank>/<h[0:3]>/<h[3:5]>_g<group>/<h>.bin         one block file
  <model>_<digest12>_r<rank>/<h[0:3]>/<h[3:5]>_g<group>/<h>.bin_<n>.tmp  a store in progress

where <h> is the block hash in hex: 64 digits (sha256, the default) or 32 (xxhash). Only `_r0`
exists in practice and each file holds every worker's bytes, so one block is one file and one
page. A rank dir is vLLM's only if its `<model>_<digest12>` sibling holds a config.json whose
fields hash to that digest (vLLM's own rule, file_mapper.py); config.json itself sits one
level above any page and is never a page, a temp or deletable.

A store is makedirs + open(tmp, O_EXCL) + os.replace; nothing in vLLM removes a temp left by a
killed writer, so GC reaps them by age. Lookup is os.path.exists; a load os.open(O_RDONLY) +
readv + close (an IN_CLOSE_NOWRITE). A block file GC deletes under a running server is a miss.

The order of stores says nothing of which block continues which across requests (`write_order`
off): a store job writes one request's new blocks in order, but jobs follow each other with
nothing on disk between them (the lookup of a request's prefix is a stat, a prefix found in
GPU or CPU memory is not touched at all), and jobs on vLLM's pool of I/O threads interleave.
Guessing from it chained unrelated prompts into one chain, and tails-first eviction then took
the newest prompt first (tests/test_vllm_chains.py). Links come from loads alone: a request's
hit prefix is read head to tail, one job.
"""

from __future__ import annotations

import hashlib
import json
import re

from cachemgr.backends import FileFormat, Nesting, ScanRules
from cachemgr.vllm.tier import root_dirs_in_argv

IDENTITY_FILE = "config.json"
DIGEST_HEX = 12
# vLLM writes 32 (xxhash) or 64 (sha256) hex digits and nothing else: a 63-digit ".bin" is not
# its block. The scanner folds each key length into its own shape, so a shape's verdict is
# still each of its names'.
_HEX = r"(?:[0-9a-f]{32}|[0-9a-f]{64})"
PAGE_RE = re.compile(rf"(?P<key>{_HEX})\.bin")
TEMP_RE = re.compile(rf"{_HEX}\.bin_\d{{1,20}}\.tmp")
# A model's part of a folder name: not a name os.fsdecode() had to escape (\udc80-\udcff):
# vLLM writes UTF-8 names, and the index stores the paths below as UTF-8 text.
_MODEL = r"[^/\x00\udc80-\udcff]+"
FOLDER_RE = re.compile(rf"(?P<model>{_MODEL})_(?P<digest>[0-9a-f]{{{DIGEST_HEX}}})")
RANK_DIR_RE = re.compile(rf"(?P<folder>{_MODEL}_[0-9a-f]{{{DIGEST_HEX}}})_r(?P<rank>\d{{1,6}})")
HASH3_DIR_RE = re.compile(r"[0-9a-f]{3}")
GROUP_DIR_RE = re.compile(r"[0-9a-f]{2}_g\d{1,6}")


def folder_digest(config: bytes) -> str | None:
    """The folder name vLLM gives the identity in a config.json's bytes; None if they are not a
    complete JSON object of that shape (a partial write: vLLM writes it non-atomically; or a
    hostile one: "[[[..." a hundred thousand deep)."""
    try:
        fields = json.loads(config)
        if not isinstance(fields, dict) or not isinstance(fields.get("model_name"), str):
            return None
        # vLLM's own rule (file_mapper.py), not cachemgr.canonical: it follows vLLM alone.
        canon = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    digest = hashlib.sha256(canon).hexdigest()[:DIGEST_HEX]
    return f"{fields['model_name'].replace('/', '_')}_{digest}"


def vouches(folder: str, config: bytes) -> bool:
    """Whether `config` is the identity file of `folder` (its fields hash to the folder name)."""
    return FOLDER_RE.fullmatch(folder) is not None and folder_digest(config) == folder


def owner(rank_dir: str) -> str:
    """The identity folder of a rank dir: "<model>_<digest12>_r0" -> "<model>_<digest12>"."""
    m = RANK_DIR_RE.fullmatch(rank_dir)
    return m["folder"] if m else ""


VLLM_FS_TIER = FileFormat(
    name="vLLM fs tier",
    page=PAGE_RE,
    temp=TEMP_RE,
    page_suffix=".bin",
    # No temp name starts with a fixed character and hex run; "." + 32 never matches one.
    scan=ScanRules(key_min=32, key_max=64, temp_lead=".", temp_hex=32),
    nesting=Nesting(
        levels=(RANK_DIR_RE, HASH3_DIR_RE, GROUP_DIR_RE),
        owner=owner,
        identity_file=IDENTITY_FILE,
        vouches=vouches,
    ),
    write_order=False,
    argv_dirs=root_dirs_in_argv,
)
