"""FileFormat.key_len parses a name by its shape: it must give what the page pattern itself
gives each name, for every format, on names that are pages, temps, near misses and noise."""

from __future__ import annotations

import random

import pytest

from cachemgr.backends import FileFormat
from cachemgr.sglang.hicache import HICACHE_FILE, POOLS
from cachemgr.vllm.fstier import VLLM_FS_TIER

SUFFIXES = [
    ".bin",
    "_Qwen-Qwen3-8B.bin",
    "_Qwen-Qwen3-8B_0_1.bin",
    "_m_3_8_2_1.bin",
    "_m_0_2_cp1_2.bin",
    "_m_tp2_dcp0_2_page7.bin",
    *(f".{pool}_m_1_2.bin" for pool in POOLS),
    ".deepseek_v4_c4_indexerX_m.bin",  # not a pool: no page
    "_m.bin.tmp.12.34." + "a" * 32,
    ".bin_123.tmp",
    ".tmp",
    "_.bin",
    "_m.bin2",
    "_m.BIN",
    "g_m.bin",  # the run ends on a letter that is not a hex digit
    "A_m.bin",  # nor is an upper-case one
    "/x_m.bin",  # a path
    "",
    "_m\udc80.bin",  # a name os.fsdecode() escaped
]


def names(seed: int) -> list[str]:
    """Runs of hex digits of every length around the formats' key lengths, each with every
    suffix; and leading dots (SGLang's temps), upper case and noise."""
    rnd = random.Random(seed)
    out = []
    for run in [*range(0, 20), 31, 32, 33, 40, 63, 64, 65, 127, 128, 129, 140]:
        hexes = "".join(rnd.choice("0123456789abcdef") for _ in range(run))
        for suffix in SUFFIXES:
            out += [hexes + suffix, "." + hexes + suffix, hexes.upper() + suffix]
    out += ["".join(rnd.choice("0a_.Fb/x9") for _ in range(rnd.randrange(40))) for _ in range(500)]
    return out


def by_pattern(fmt: FileFormat, name: str) -> int | None:
    m = fmt.page.fullmatch(name)
    return None if m is None else m.end("key")


@pytest.mark.parametrize("fmt", [HICACHE_FILE, VLLM_FS_TIER], ids=lambda f: f.name)
def test_key_len_is_the_page_patterns_key_for_every_name(fmt: FileFormat) -> None:
    checked = names(1)
    assert {fmt.key_len(n) for n in checked} - {None}  # pages among them, of several lengths
    assert [fmt.key_len(n) for n in checked] == [by_pattern(fmt, n) for n in checked]
