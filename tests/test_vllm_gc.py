"""`cachemgr gc` (a real subprocess, no daemon) on a vLLM namespace of hand-made hashed dirs:
the dry run says what the real run deletes, the oldest blocks and stale temps go, and
config.json, the O_DIRECT probe, foreign files, young temps and symlink targets stay."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from cachemgr.state.store import Store
from tests.daemon_helpers import running_daemon
from tests.gc_helpers import page_bytes
from tests.nsfixtures import cli, snapshot
from tests.polling import wait_for
from tests.test_gc_cli import gc
from tests.vllmtrees import (
    block_path,
    key,
    vllm_namespace,
    vllm_store,
    vllm_tree,
    write_blocks,
    write_folder,
)

T0 = 1_000_000.0


def planted_tree(root: Path) -> tuple[Path, list[str], Path]:
    layout = Layout.at(root)
    create_root(layout)
    store = Store.open(layout.db_path)
    try:
        ns = vllm_namespace(layout, store)
    finally:
        store.close()
    d = layout.ns_dir(ns)
    folder = write_folder(d)
    blocks = [
        b
        for i in range(10)
        for b in write_blocks(d, folder, 1, size=1000, start=i, mtime=T0 + 100 * i)
    ]
    stale = d / (blocks[0] + "_1234.tmp")  # a writer killed mid-store
    young = d / (blocks[1] + "_99.tmp")  # a store in progress
    for tmp, at in ((stale, T0), (young, None)):
        tmp.write_bytes(b"t" * 10)
        if at:
            os.utime(tmp, (at, at))
    probe = d / folder / ".o_direct_probe_5.tmp"
    probe.write_bytes(b"p")
    os.utime(probe, (T0, T0))
    (d / folder / "notes.txt").write_text("mine")
    outside = root.parent / "outside"
    write_blocks(outside, folder, 3, size=1000, mtime=T0 - 1000)
    os.symlink(outside / f"{folder}_r0", d / f"{folder}_r1")  # a rank dir that is a link
    return d, blocks, outside


def test_dry_run_equals_the_real_run_and_spares_what_is_not_a_block(root: Path) -> None:
    d, blocks, outside = planted_tree(root)
    before_outside, before = snapshot(outside), snapshot(d)
    dry = gc(root, "--dry-run", "--json", "--max-bytes", "5kB", "--min-age", "0")
    assert dry.returncode == 0, dry.stderr
    assert snapshot(d) == before  # the dry run deleted nothing
    real = gc(root, "--yes", "--json", "--max-bytes", "5kB", "--min-age", "0")
    assert real.returncode == 0, real.stderr
    planned, done = json.loads(dry.stdout), json.loads(real.stdout)
    assert (planned["files"], planned["bytes"]) == (done["files"], done["bytes"]) == (7, 6010)
    left = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() or p.is_symlink())
    folder = blocks[0].split("_r0/")[0]
    assert left == sorted(
        [
            *blocks[6:],
            blocks[1] + "_99.tmp",
            f"{folder}/config.json",
            f"{folder}/.o_direct_probe_5.tmp",
            f"{folder}/notes.txt",
            f"{folder}_r1",
        ]
    )
    assert snapshot(outside) == before_outside


def test_purge_and_ls_see_a_vllm_namespace_and_the_trash_keeps_only_config(root: Path) -> None:
    d, blocks, outside = planted_tree(root)
    ns = d.name
    listed = json.loads(cli("--root", str(root), "ls", "--json").stdout)["namespaces"]
    (row,) = [n for n in listed if n["ns_id"] == ns]
    assert (row["engine"], row["pages"], row["bytes"], row["temps"]) == ("vllm", 10, 10_000, 2)
    status = json.loads(cli("--root", str(root), "status", "--port", "1", "--json").stdout)
    (ns_row,) = [n for n in status["namespaces"] if n["id"] == ns]
    assert (ns_row["engine"], ns_row["pages"], ns_row["temp_files"]) == ("vllm", 10, 2)
    table = cli("--root", str(root), "status", "--port", "1", "--wide").stdout
    assert any(ns in line and "vllm" in line for line in table.splitlines()), table
    before_outside = snapshot(outside)
    out = cli("--root", str(root), "purge", "--namespace", ns, "--yes", "--json")
    got = json.loads(out.stdout)
    assert got["result"]["purged"][0]["pages"] == 10
    # The blocks, temps, hashed dirs and then vLLM's identity file are gone; what stays is
    # the probe and the foreign file beside it, and the planted link (never followed).
    (entry,) = list((root / ".trash").iterdir())
    left = sorted(str(p.relative_to(entry)) for p in entry.rglob("*"))
    folder = blocks[0].split("_r0/")[0]
    assert left == sorted(
        [folder, f"{folder}/.o_direct_probe_5.tmp", f"{folder}/notes.txt", f"{folder}_r1"]
    )
    assert out.returncode == 1 and "not removed: Directory not empty" in out.stderr
    assert snapshot(outside) == before_outside


def test_a_purged_vllm_namespace_of_blocks_only_leaves_nothing(root: Path) -> None:
    layout = Layout.at(root)
    create_root(layout)
    with Store.open(layout.db_path) as store:
        ns = vllm_namespace(layout, store)
    write_blocks(layout.ns_dir(ns), write_folder(layout.ns_dir(ns)), 20)
    out = cli("--root", str(root), "purge", "--namespace", ns, "--yes")
    assert out.returncode == 0, out.stderr
    assert list((root / ".trash").iterdir()) == []


def test_a_second_digest_folder_of_another_block_size_is_not_torn(root: Path) -> None:
    layout = Layout.at(root)
    create_root(layout)
    with Store.open(layout.db_path) as store:
        ns = vllm_namespace(layout, store)
    d = layout.ns_dir(ns)
    bf16, fp8 = write_folder(d), write_folder(d, dtype="fp8_e4m3")
    write_blocks(d, bf16, 6, size=1000, mtime=T0)
    write_blocks(d, fp8, 3, size=500, start=100, mtime=T0)  # half the bytes: another KV dtype
    torn = write_blocks(d, bf16, 1, size=10, start=200, mtime=T0)[0]  # a short block
    out = gc(root, "--yes", "--json", "--min-age", "0")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["by_reason"] == {"corrupt": {"files": 1, "bytes": 10}}
    assert not (d / torn).exists() and len(list(d.rglob("*.bin"))) == 9


def test_an_unbound_vllm_namespace_is_dropped_whole(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = Layout.at(root)
    create_root(layout)
    with Store.open(layout.db_path) as store:
        ns = vllm_namespace(layout, store)
    write_blocks(layout.ns_dir(ns), write_folder(layout.ns_dir(ns)), 12, size=100, mtime=T0)
    monkeypatch.setenv("CACHEMGR_GC_KEEP_UNBOUND", "0")
    out = gc(root, "--yes", "--json", "--min-age", "0")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["by_reason"] == {"unbound": {"files": 12, "bytes": 1200}}
    assert not layout.ns_dir(ns).exists() and list((root / ".trash").iterdir()) == []


def test_a_dry_run_counts_nothing_in_a_hashed_dir_the_real_run_cannot_delete_in(
    root: Path,
) -> None:
    """A hashed dir that refuses unlinks (immutable here: EPERM even for root; another user's
    chmod for a non-root daemon): the dry run plans and counts as the real run, which refuses
    that dir's blocks, deletes the rest and exits 1: the cap was not held."""
    d, blocks, _ = planted_tree(root)
    stuck = (d / blocks[0]).parent
    subprocess.run(["chattr", "+i", str(stuck)], check=True)
    try:
        dry = gc(root, "--dry-run", "--json", "--max-bytes", "5kB", "--min-age", "0")
        real = gc(root, "--yes", "--json", "--max-bytes", "5kB", "--min-age", "0")
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
    assert (dry.returncode, real.returncode) == (0, 1), dry.stderr + real.stderr
    assert "the limit was not held: 2 files" in real.stderr
    planned, done = json.loads(dry.stdout), json.loads(real.stdout)
    assert done["held"] is False and "cannot be deleted by uid 0" in done["warnings"][0]
    assert (planned["files"], planned["bytes"]) == (done["files"], done["bytes"]) == (5, 5000)
    assert (d / blocks[0]).exists() and (d / (blocks[0] + "_1234.tmp")).exists()
    assert not any((d / b).exists() for b in blocks[1:6])
    refused = [[r for step in out["steps"] for r in step["refused"]] for out in (planned, done)]
    assert refused[0] == refused[1] and "Permission denied" in refused[0][0]


def test_vllm_stores_the_index_has_not_applied_count_against_the_cap(root: Path) -> None:
    """The daemon's GC counts blocks vLLM stored that the index has not applied yet (its
    batch is ten seconds away), woken by the inotify thread: the cap holds, and the blocks it
    took are the old ones (the new ones are in flight)."""
    layout = Layout.at(root)
    create_root(layout)
    with Store.open(layout.db_path) as store:
        _, d, folder = vllm_tree(layout, store)
    write_blocks(d, folder, 900, size=1000)  # 0.9 of the cap, indexed by the start-up scan
    settings = load_settings(
        root=root,
        gc_max_bytes=1_000_000,
        gc_high_watermark=1.0,
        gc_low_watermark=0.9,
        gc_min_age=0,
        gc_interval=3600,
        gc_delete_rate=1e9,
        batch_interval=10,
    )
    new = [block_path(folder, key(i)) for i in range(900, 1200)]
    with running_daemon(settings) as dm:
        for rel in new:  # 1.2 of the cap on disk
            vllm_store(d, rel, 1000)

        wait_for(lambda: page_bytes(d), lambda b: b <= 1_000_000, timeout=8, what="the cap")
        assert dm.daemon.indexer.state.events_applied == 0
    assert all((d / rel).exists() for rel in new)
