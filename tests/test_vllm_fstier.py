"""vLLM's fs tier as a cachemgr file format (cachemgr.vllm.fstier) on hand-made trees: what is a
block, a temp or foreign, and that the C scanner, the Python listing and the index agree on a
nested namespace without entering a symlink or a folder its config.json does not vouch for."""

from __future__ import annotations

import json
import os
from pathlib import Path

from cachemgr.backends import FileKind
from cachemgr.formats import engine_of, format_for
from cachemgr.fs._dirscan import page_digest
from cachemgr.fs.deletion import Listeners, delete_files
from cachemgr.fs.dirscan import TEMPS, list_files, scan_usage
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.sglang.hicache import HICACHE_FILE
from cachemgr.state.index import scan_namespace
from cachemgr.state.store import Store
from cachemgr.vllm.fstier import VLLM_FS_TIER, folder_digest
from tests.vllmtrees import block_path, key, write_blocks, write_folder

FMT = VLLM_FS_TIER
NS = "0123456789abcdef"


def test_names_block_files_temps_and_the_identity_file() -> None:
    folder = "Qwen_Qwen3-0.6B_50fed47cc494"
    block = block_path(folder, key(1))
    assert FMT.classify_path(block) is FileKind.PAGE
    assert FMT.classify_path(block_path(folder, key(1, 32))) is FileKind.PAGE  # xxhash
    assert FMT.classify_path(block + "_123456789.tmp") is FileKind.TEMP
    for foreign in (
        f"{folder}/config.json",
        f"{folder}/.o_direct_probe_12.tmp",
        f"{folder}_r0/{key(1)}.bin",
        f"{folder}_r0/abc/{key(1)}.bin",
        f"{folder}_r0/abc/de_g0/notes.txt",
        f"{folder}_r0/abc/de_gx/{key(1)}.bin",
        f"other_r0/abc/de_g0/{key(1)}.bin",
        f"{folder}_r0/../abc/de_g0/{key(1)}.bin",
        key(1) + ".bin",
    ):
        assert FMT.classify_path(foreign) is FileKind.FOREIGN, foreign
    # SGLang's flat names are not vLLM's, and the other way round
    assert HICACHE_FILE.classify_path(block) is FileKind.FOREIGN


def test_the_engine_comes_from_the_identity_record() -> None:
    assert engine_of({"engine": "vllm"}) == "vllm" and format_for({"engine": "vllm"}) is FMT
    assert engine_of({}) == "sglang" and format_for(None) is HICACHE_FILE


def test_a_folder_is_vouched_for_only_by_its_own_complete_config(tmp_path: Path) -> None:
    folder = write_folder(tmp_path)
    raw = (tmp_path / folder / "config.json").read_bytes()
    assert folder_digest(raw) == folder
    assert folder_digest(raw[:-5]) is None  # vLLM writes it non-atomically: a partial one
    other = json.loads(raw) | {"dtype": "fp8"}
    assert folder_digest(json.dumps(other).encode()) != folder


def nested_root(tmp_path: Path) -> tuple[Layout, Path, str]:
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    ns_dir = layout.ns_dir(NS)
    ns_dir.mkdir()
    return layout, ns_dir, write_folder(ns_dir)


def test_scan_and_listing_see_the_blocks_in_vouched_hashed_dirs_only(tmp_path: Path) -> None:
    layout, ns_dir, folder = nested_root(tmp_path)
    blocks = write_blocks(ns_dir, folder, 40, size=4096)
    tmp = ns_dir / (blocks[0] + "_77.tmp")
    tmp.write_bytes(b"x" * 10)
    # a folder whose config.json names another identity: foreign, whatever is in it
    stray = "Qwen_Qwen3-0.6B_000000000000"
    (ns_dir / stray).mkdir()
    (ns_dir / stray / "config.json").write_bytes((ns_dir / folder / "config.json").read_bytes())
    write_blocks(ns_dir, stray, 5)
    # symlinks planted at each level of the hashed dirs lead outside: never entered
    outside = tmp_path / "outside"
    write_blocks(outside, folder, 3)
    os.symlink(
        outside / f"{folder}_r0" / block_path(folder, key(0)).split("/")[1],
        ns_dir / f"{folder}_r0" / "fff",
    )
    os.symlink(outside / f"{folder}_r0", ns_dir / f"{folder}_r1")
    linked = blocks[1][: -len(key(1)) - 4] + key(1)[:5] + "0" * 59 + ".bin"
    os.symlink(outside / blocks[1], ns_dir / linked)

    # a level-1 name one level down (the scanner remembers each level's verdicts apart)
    hhh = blocks[2].split("/")[1]
    (ns_dir / f"{folder}_r0" / hhh / hhh).mkdir()
    (ns_dir / f"{folder}_r0" / hhh / hhh / (key(2) + ".bin")).write_bytes(b"m")
    usage = scan_usage(layout, f"ns/{NS}", FMT)
    assert usage is not None
    assert (usage.pages, usage.files, usage.bytes) == (40, 40, 40 * 4096)
    assert (usage.temps, usage.temp_bytes) == (1, 10)
    assert usage.digest == _xor(page_digest(b, 4096) for b in blocks)

    listed = {f.name: f for f in list_files(layout, f"ns/{NS}", fmt=FMT)}
    assert set(listed) == {*blocks, blocks[0] + "_77.tmp"}
    assert listed[blocks[3]].key_len == len(blocks[3])  # one file, one page: its whole path
    assert [f.name for f in list_files(layout, f"ns/{NS}", TEMPS, FMT)] == [blocks[0] + "_77.tmp"]


def test_the_index_of_a_nested_namespace_matches_its_scan(tmp_path: Path) -> None:
    layout, ns_dir, folder = nested_root(tmp_path)
    blocks = write_blocks(ns_dir, folder, 30)
    store = Store.open(layout.db_path)
    first = scan_namespace(layout, store, NS, fmt=FMT)
    assert (first.pages, first.added) == (30, 30)
    rows = {r[0] for r in store.conn.execute("SELECT name FROM pages")}
    assert rows == set(blocks)
    again = scan_namespace(layout, store, NS, fmt=FMT)
    assert again.drift == 0  # the trigger-kept digest equals the scanner's over full paths
    (ns_dir / blocks[0]).unlink()
    assert scan_namespace(layout, store, NS, fmt=FMT).removed == 1


def _xor(values: object) -> int:
    out = 0
    for v in values:  # type: ignore[attr-defined]
        out ^= v
    return out


def test_deletion_takes_blocks_and_temps_of_vouched_dirs_only(tmp_path: Path) -> None:
    layout, ns_dir, folder = nested_root(tmp_path)
    blocks = write_blocks(ns_dir, folder, 6)
    stray = "Qwen_Qwen3-0.6B_000000000000"  # no config.json vouches for it
    strays = write_blocks(ns_dir, stray, 2)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / (key(7) + ".bin")).write_bytes(b"o")
    link_dir = block_path(folder, key(7)).rsplit("/", 1)[0]
    (ns_dir / link_dir).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside, ns_dir / link_dir)  # a hashed dir that is a link
    asked = [
        *blocks,
        *strays,
        f"{folder}/config.json",
        block_path(folder, key(7)),
        f"{folder}_r0/{key(1)}.bin",
        "../" + blocks[0],
    ]
    dry = delete_files(layout.root, f"ns/{NS}", asked, fmt=FMT, dry_run=True)
    gone: list[str] = []
    heard = Listeners(removed=lambda name, _: gone.append(name))
    real = delete_files(layout.root, f"ns/{NS}", asked, fmt=FMT, listeners=heard)
    assert (dry.files, dry.bytes, len(dry.refused)) == (real.files, real.bytes, len(real.refused))
    assert real.files == 6 and sorted(gone) == sorted(blocks)
    assert len(real.refused) == 6  # 2 strays, config.json, the linked dir, 2 misplaced names
    assert all((ns_dir / s).exists() for s in strays)
    assert (ns_dir / folder / "config.json").exists() and (outside / (key(7) + ".bin")).exists()
