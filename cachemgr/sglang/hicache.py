"""SGLang's HiCacheFile storage backend as a cachemgr file format (cachemgr.backends).

HiCacheFile (sglang/srt/mem_cache/hicache_storage.py; 0.5.23 and the newer upstream source)
names a page file
  <key>[.<pool>]_<model>[_<tp_rank>_<tp_size>][_<pp_size>_<pp_rank>][_cp<r>_<s>]
      [_tp<tp>_dcp<r>_<s>_page<n>].bin
where <key> is the page's sha256 hex hash, <pool> an extra memory pool (PoolName, KV has
none), <model> the served model name with "/" replaced by "-", and the TP pair is absent for
MLA models (whose mamba pool keeps it: it is TP-sharded). The PP pair and the CP part appear
only when those are in use.

One logical page is every file with its key: the KV file and each pool's file on every TP,
PP and CP rank. SGLang loads a prefix only as far as every pool has it (`batch_exists_v2`
takes the minimum over pools) and every rank has it (the hit count is all-reduced with MIN
across ranks), so a page missing any one of its files is a miss: GC keeps or evicts them
together.

Writes go through a temp file and os.replace: 0.5.23 writes ".<uuid4 hex>.tmp"; another
upstream revision writes "<page file name>.tmp.<pid>.<thread id>.<uuid4 hex>".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cachemgr.backends import FileFormat, ScanRules

# The dir HiCacheFile writes to, read from the server's environment before anything else.
STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"

# PoolName's values but "kv" (the page's own file), as of 0.5.23. Longest first: a pool name
# may be another's prefix ("deepseek_v4_c4" / "deepseek_v4_c4_indexer") and the first
# alternative that matches is the one the parser reports.
POOLS = tuple(
    sorted(
        (
            "mamba",
            "swa",
            "auxiliary_swa",
            "indexer",
            "deepseek_v4_c1",
            "deepseek_v4_c1_indexer",
            "deepseek_v4_c1_indexer_scale",
            "deepseek_v4_c2",
            "deepseek_v4_c2_indexer",
            "deepseek_v4_c2_indexer_scale",
            "deepseek_v4_c4",
            "deepseek_v4_c4_indexer",
            "deepseek_v4_c4_indexer_scale",
            "deepseek_v4_c128",
            "deepseek_v4_c4_rope",
            "deepseek_v4_c128_rope",
            "deepseek_v4_c4_state",
            "deepseek_v4_c4_indexer_state",
            "deepseek_v4_c128_state",
            "draft",
            "draft_indexer",
            "draft_swa",
        ),
        key=lambda p: (-len(p), p),
    )
)
_PAGE = (
    r"(?P<key>[0-9a-f]{16,128})"
    rf"(?:\.(?P<pool>{'|'.join(POOLS)}))?"
    # not a name os.fsdecode() had to escape (\udc80-\udcff): SGLang writes UTF-8 names
    r"_(?P<model>[^/\x00\udc80-\udcff]+?)"
    r"(?:_(?P<tp_rank>\d+)_(?P<tp_size>\d+))?"
    r"(?:_(?P<pp_size>\d+)_(?P<pp_rank>\d+))?"
    r"(?:_cp(?P<cp_rank>\d+)_(?P<cp_size>\d+))?"
    r"(?:_tp(?P<dcp_tp>\d+)_dcp(?P<dcp_rank>\d+)_(?P<dcp_size>\d+)_page(?P<dcp_page>\d+))?"
    r"\.bin"
)
PAGE_RE = re.compile(_PAGE)
# A page's whole path for find -regex (posix-extended), as doctor's fixes delete pages with:
# the key's bounds as _PAGE's, so no other program's *.bin (a LoRA's adapter_model.bin)
PAGE_ERE = r".*/[0-9a-f]{16,128}(\.[0-9a-z_]+)?_[^/]+\.bin"
# The page name's groups are not named again: the pattern may hold each name once.
TEMP_RE = re.compile(
    r"\.[0-9a-f]{32}\.tmp|" + re.sub(r"\?P<\w+>", "", _PAGE) + r"\.tmp\.\d+\.\d+\.[0-9a-f]{32}"
)

HICACHE_FILE = FileFormat(
    name="SGLang HiCacheFile",
    page=PAGE_RE,
    temp=TEMP_RE,
    page_suffix=".bin",
    scan=ScanRules(key_min=16, key_max=128, temp_lead=".", temp_hex=32),
    dir_env=STORAGE_DIR_ENV,
)


@dataclass(frozen=True)
class PageName:
    """The parts of one SGLang page file name; `str()` gives the name back."""

    key: str
    model: str
    pool: str | None = None
    tp_rank: int | None = None
    tp_size: int | None = None
    pp_size: int | None = None
    pp_rank: int | None = None
    cp_rank: int | None = None
    cp_size: int | None = None
    dcp: tuple[int, int, int, int] | None = None  # (tp_size, dcp_rank, dcp_size, page_size)

    def __str__(self) -> str:
        s = self.key + (f".{self.pool}" if self.pool else "") + f"_{self.model}"
        if self.tp_rank is not None:
            s += f"_{self.tp_rank}_{self.tp_size}"
        if self.pp_size is not None:
            s += f"_{self.pp_size}_{self.pp_rank}"
        if self.cp_rank is not None:
            s += f"_cp{self.cp_rank}_{self.cp_size}"
        if self.dcp is not None:
            s += "_tp{}_dcp{}_{}_page{}".format(*self.dcp)
        return s + ".bin"


def parse_page_name(name: str) -> PageName | None:
    """Parse an SGLang page file name; None for anything else."""
    m = PAGE_RE.fullmatch(name)
    if m is None:
        return None
    g = m.groupdict()

    def num(k: str) -> int | None:
        return int(g[k]) if g[k] is not None else None

    dcp = None
    if g["dcp_tp"] is not None:
        dcp = (int(g["dcp_tp"]), int(g["dcp_rank"]), int(g["dcp_size"]), int(g["dcp_page"]))
    return PageName(
        key=g["key"],
        model=g["model"],
        pool=g["pool"],
        tp_rank=num("tp_rank"),
        tp_size=num("tp_size"),
        pp_size=num("pp_size"),
        pp_rank=num("pp_rank"),
        cp_rank=num("cp_rank"),
        cp_size=num("cp_size"),
        dcp=dcp,
    )
