"""`cachemgr gc` as a user meets it: a real subprocess on a real root."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cachemgr.gc import execute
from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from cachemgr.state import store as store_module
from tests.daemon_helpers import cli_argv
from tests.gc_helpers import NS, Tree, page, temp
from tests.locks import ForeignLock, cli_here


def gc(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *cli_argv(root),
            "gc",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def no_daemon_root(root: Path) -> None:
    """Files SGLang left with no daemon watching: GC must scan them itself."""
    d = root / "ns" / NS
    d.mkdir(parents=True)
    for i in range(10):
        (d / page(i)).write_bytes(b"k" * 1000)
        os.utime(d / page(i), (1_000_000 + 100 * i, 1_000_000 + 100 * i))  # apart: not one burst
    (d / temp(1)).write_bytes(b"t" * 10)
    os.utime(d / temp(1), (1_000_000, 1_000_000))


def test_dry_run_lists_per_reason_and_deletes_nothing(root: Path) -> None:
    no_daemon_root(root)
    out = gc(root, "--dry-run", "--max-bytes", "5kB", "--min-age", "0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "would delete 7 files, 6.0 kB",
        "  reason           files      bytes",
        "  cap                  6     6.0 kB",
        "  tmp                  1       10 B",
    ]
    assert len(os.listdir(root / "ns" / NS)) == 11


def test_json_run_frees_what_the_dry_run_said(root: Path) -> None:
    no_daemon_root(root)
    dry = json.loads(gc(root, "--dry-run", "--json", "--max-bytes", "5kB").stdout)
    real = gc(root, "--yes", "--json", "--max-bytes", "5kB")
    assert real.returncode == 0, real.stderr
    done = json.loads(real.stdout)
    assert (dry["files"], dry["bytes"], dry["dry_run"]) == (7, 6010, True)
    assert (done["files"], done["bytes"], done["dry_run"]) == (7, 6010, False)
    assert sorted(os.listdir(root / "ns" / NS)) == [page(i) for i in range(6, 10)]  # newest stay


def test_without_a_terminal_it_needs_yes(root: Path) -> None:
    no_daemon_root(root)
    out = gc(root, "--max-bytes", "5kB")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "cachemgr: error: gc deletes files: pass --yes when not on a terminal (or --dry-run)"
    ]
    assert len(os.listdir(root / "ns" / NS)) == 11


def test_a_bad_limit_is_one_line_naming_the_setting(root: Path) -> None:
    out = gc(root, "--dry-run", "--max-bytes", "lots")
    assert out.returncode == 2
    assert out.stderr.startswith(
        "cachemgr: error: invalid gc_max_bytes (`cachemgr gc --max-bytes`, "
        "env CACHEMGR_GC_MAX_BYTES)"
    )
    assert len(out.stderr.strip().splitlines()) == 1


def test_settings_parse_sizes_and_durations(root: Path) -> None:
    s = load_settings(
        root=root,
        gc_max_bytes="1.5TiB",
        gc_tmp_ttl="1h30m",
        gc_unbound_ttl="7d",
        gc_min_age=30,
        gc_min_free_bytes="500GB",
    )
    assert int(s.gc_max_bytes or 0) == int(1.5 * 2**40)
    assert s.gc_tmp_ttl.total_seconds() == 5400
    assert s.gc_unbound_ttl is not None and s.gc_unbound_ttl.days == 7
    assert (s.gc_min_age.total_seconds(), int(s.gc_min_free_bytes)) == (30, 500 * 10**9)


def test_gc_on_an_indexed_root_keeps_the_index_order(root: Path) -> None:
    tree = Tree.at(root)
    names = [page(i) for i in range(10)]
    tree.write(NS, names, at=1_000_000.0)
    tree.read(NS, names[:2], at=1_000_100.0)  # read after everything else was written
    tree.store.close()
    out = gc(root, "--yes", "--max-bytes", "5kB", "--min-age", "0")
    assert out.returncode == 0, out.stderr
    # the index's recency wins over file mtimes: the two pages read last stay
    assert set(names[:2]) <= set(os.listdir(root / "ns" / NS))


def test_a_run_stopped_by_a_foreign_lock_shows_what_it_deleted_then_fails(
    root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A person's `sqlite3` shell takes the state DB's write lock between two of GC's chunks:
    the run stops deleting, and the CLI exited 1 naming the holder without a word of the
    files it had already deleted. It now prints them first. In this process: the lock must
    come right after the first chunk's record (GC's own function, wrapped to take it)."""
    d = root / "ns" / NS
    d.mkdir(parents=True)
    for i in range(600):
        (d / page(i)).write_bytes(b"k" * 100)
    monkeypatch.setattr(store_module, "BUSY_TIMEOUT", 0.3)  # a write's patience
    monkeypatch.setattr(store_module, "LOCK_POLL", 0.05)
    foreign = ForeignLock(Layout.at(root).db_path)  # (the DB is made by the run)
    record = execute._record_chunk

    def then_lock(*args: Any, **kw: Any) -> None:
        record(*args, **kw)
        if not foreign.taken:
            foreign.take()

    monkeypatch.setattr(execute, "_record_chunk", then_lock)
    with foreign:
        code = cli_here(
            ["--root", str(root), "--log-level", "error", "gc", "--yes", "--max-files", "100"]
        )
    out, err = capsys.readouterr()
    assert code == 1
    left = sum(1 for p in d.iterdir() if p.name.endswith(".bin"))
    assert left == 600 - 256  # the first chunk went, no other
    assert out.startswith("deleted 256 files, 25.6 kB\n") and "  files              256" in out
    assert "cachemgr: error: state DB" in err and "write-locked by" in err
