"""`cachemgr gc` as a user meets it: a real subprocess on a real root."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from cachemgr.settings import load_settings
from tests.daemon_helpers import cli_argv
from tests.gc_helpers import NS, Tree, page, temp


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
