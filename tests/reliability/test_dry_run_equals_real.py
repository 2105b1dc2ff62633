"""`gc --dry-run` lists what `gc --yes` then deletes, for every reason GC deletes for: trash,
temps (SGLang's and cachemgr's own), unbound and idle namespaces, torn pages, the byte cap, a
namespace cap and free space, by the floor pass (a real, loop-mounted ext4 below its floor) and
by the regular plan; also a floor no disk can meet (issue 26 point 8: the dry run said
`nothing to delete`, the real run deleted every page).

Each case runs the real CLI twice on one root: the dry run's steps (reason, dir, files, bytes)
must be the real run's, and the files gone from the disk must be the ones it counted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.ns.registry import ensure_namespace
from cachemgr.state.store import Store
from tests.nsfixtures import cli_process, make_ns, page_name

OLD = 1_000_000_000.0
MANIFEST = re.compile(r"ns/[0-9a-f]{16}\.json")
MiB = 1 << 20


def _old(*paths: Path) -> None:
    for p in paths:
        os.utime(p, (OLD, OLD))


def _bound(layout: Layout, name: str, pages: int, size: int = 100, start: int = 0) -> Path:
    """A namespace bound to an instance (never dropped as unbound), with old pages."""
    with Store.open(layout.db_path) as store:
        ns = make_ns(layout, store, name, pages=0, instance=f"gpu-{name}")
    d = layout.ns_dir(ns)
    for i in range(start, start + pages):
        (d / page_name(i, name)).write_bytes(bytes([i % 251]) * size)
        _old(d / page_name(i, name))
    return d


def _idle(layout: Layout, name: str, pages: int) -> Path:
    """An unbound namespace last active long ago, with old pages."""
    digest = hashlib.sha256(name.encode()).hexdigest()[:32]
    identity = {
        "kv_cache_dtype": "bfloat16",
        "page_size": 64,
        "source": {"served_model_name": name},
    }
    with Store.open(layout.db_path) as store:
        ensure_namespace(
            layout, store, ns_id=digest[:16], digest=digest, identity=identity, now=OLD
        )
    d = layout.ns_dir(digest[:16])
    for i in range(pages):
        (d / page_name(i, name)).write_bytes(b"u" * 100)
        _old(d / page_name(i, name))
    return d


def trash(layout: Layout) -> tuple[str, ...]:
    entry = layout.trash / "0123456789abcdef.x1"
    entry.mkdir()
    for i in range(4):
        (entry / page_name(i)).write_bytes(b"t" * 100)
    _bound(layout, "keep", 2)
    return ()


def temps(layout: Layout) -> tuple[str, ...]:
    d = _bound(layout, "a", 2)
    (d / f".{'ab' * 16}.tmp").write_bytes(b"x" * 10)  # a killed SGLang write
    own = layout.root / "ns" / f".{d.name}.json.{'c' * 12}.tmp-cachemgr"  # a killed cachemgr write
    own.write_bytes(b"{")
    _old(d / f".{'ab' * 16}.tmp", own)
    return ("--tmp-ttl", "1s")


def unbound(layout: Layout) -> tuple[str, ...]:
    _bound(layout, "a", 2)
    with Store.open(layout.db_path) as store:
        for name in ("u1", "u2"):
            d = layout.ns_dir(make_ns(layout, store, name, pages=3))
            _old(*d.iterdir())
    return ()


def idle(layout: Layout) -> tuple[str, ...]:
    _bound(layout, "a", 2)
    _idle(layout, "gone-for-long", 3)
    return ()


def torn(layout: Layout) -> tuple[str, ...]:
    d = _bound(layout, "a", 5)
    with open(d / page_name(2, "a"), "r+b") as f:
        f.truncate(40)
    _old(d / page_name(2, "a"))
    return ()


def cap(layout: Layout) -> tuple[str, ...]:
    _bound(layout, "a", 6)
    _bound(layout, "b", 6)
    return ("--max-bytes", "500")


def namespace_cap(layout: Layout) -> tuple[str, ...]:
    _bound(layout, "a", 10)
    _bound(layout, "b", 2)
    return ("--namespace-max-bytes", "500")


def floor_out_of_reach(layout: Layout) -> tuple[str, ...]:
    """The issue's case: a floor the disk cannot meet even with the cache empty."""
    _bound(layout, "a", 10, size=1000)
    return ("--min-free-percent", "99.9")


def floor_with_young_pages(layout: Layout) -> tuple[str, ...]:
    """Out of reach, and some pages too young to go: both runs take the old ones only."""
    d = _bound(layout, "a", 5, size=1000)
    for i in range(5, 8):
        (d / page_name(i, "a")).write_bytes(b"n" * 1000)
    return ("--min-free-percent", "99.9", "--min-age", "1h")


def everything(layout: Layout) -> tuple[str, ...]:
    trash(layout)
    temps(layout)
    unbound(layout)
    idle(layout)
    torn(layout)
    _bound(layout, "c", 8)
    return ("--tmp-ttl", "1s", "--max-bytes", "1200", "--namespace-max-bytes", "700")


CASES: dict[str, Callable[[Layout], tuple[str, ...]]] = {
    f.__name__: f
    for f in (
        trash,
        temps,
        unbound,
        idle,
        torn,
        cap,
        namespace_cap,
        floor_out_of_reach,
        floor_with_young_pages,
        everything,
    )
}
ENV = {"CACHEMGR_GC_KEEP_UNBOUND": "1", "CACHEMGR_GC_UNBOUND_TTL": "30d"}


def files_below(top: Path) -> set[str]:
    return {str(p.relative_to(top)) for p in top.rglob("*") if p.is_file()}


def dry_then_real(layout: Layout, *args: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """`gc --dry-run` then `gc --yes` with these limits: both JSON reports, once each has been
    checked against the other and against the disk."""
    common = ("--root", str(layout.root), "gc", "--json", "--min-age", "0", *args)
    before = files_below(layout.root)
    dry = cli_process(*common, "--dry-run", env=ENV)
    assert dry.returncode == 0, dry.stderr
    assert files_below(layout.root) == before  # a dry run deletes nothing
    real = cli_process(*common, "--yes", env=ENV)
    d, r = json.loads(dry.stdout), json.loads(real.stdout)
    # A limit the dry run finds out of reach is missed by the real run too, which exits 1.
    assert real.returncode == (0 if d["held"] else 1), real.stderr
    assert (d["held"], _limits(d)) == (r["held"], _limits(r)), (d, r)

    def steps(report: dict[str, Any]) -> list[tuple[str, str, int, int]]:
        return [(s["reason"], s["dir"], s["files"], s["bytes"]) for s in report["steps"]]

    assert steps(d) == steps(r), (d, r)
    assert (d["files"], d["bytes"], d["by_reason"]) == (r["files"], r["bytes"], r["by_reason"])
    gone = before - files_below(layout.root)
    # not counted as files: the DB's own (-wal, -shm) and a dropped namespace's manifest
    pages_gone = [g for g in gone if not g.startswith(".cachemgr") and not MANIFEST.fullmatch(g)]
    assert len(pages_gone) == r["files"], (sorted(pages_gone), r)
    return d, r


def _limits(report: dict[str, Any]) -> list[tuple[str, str | None]]:
    """The limits a report says were not held (how much is missing moves with the disk)."""
    return [(u["limit"], u["namespace_id"]) for u in report["unmet"]]


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    out = Layout.at(tmp_path / "root")
    create_root(out)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_dry_run_lists_what_the_real_run_deletes(layout: Layout, case: str) -> None:
    args = CASES[case](layout)
    _dry, real = dry_then_real(layout, *args)
    assert real["files"] > 0, real  # every case has something to delete
    # Only a floor no filesystem meets is missed; every other limit is held.
    assert real["held"] == (not case.startswith("floor_")), real
    expected = {
        "trash": {"trash"},
        "temps": {"tmp"},
        "unbound": {"unbound"},
        "idle": {"ttl"},
        "torn": {"corrupt"},
        "cap": {"cap"},
        "namespace_cap": {"cap"},
        "floor_out_of_reach": {"free_space"},
        "floor_with_young_pages": {"free_space"},
        "everything": {"trash", "tmp", "unbound", "ttl", "corrupt", "cap"},
    }[case]
    assert set(real["by_reason"]) == expected, real["by_reason"]


def fill(d: Path, n: int, start: int = 0) -> None:
    """n old pages of 1 MiB (whole blocks: freeing one frees exactly its size)."""
    for i in range(start, start + n):
        (d / page_name(i, "a")).write_bytes(os.urandom(MiB))
        os.utime(d / page_name(i, "a"), (OLD + i, OLD + i))


@pytest.fixture
def fs_layout(small_fs: Path) -> Layout:
    """A root on a 64 MiB ext4 of its own (the state dir too), 40 MiB of it old pages, a trash
    entry and a stale temp."""
    layout = Layout.at(small_fs / "root")
    create_root(layout)
    d = _bound(layout, "a", 0)
    fill(d, 40)
    entry = layout.trash / "0123456789abcdef.x1"
    entry.mkdir()
    (entry / page_name(0)).write_bytes(os.urandom(MiB))
    (d / f".{'ab' * 16}.tmp").write_bytes(b"x" * 4096)
    _old(d / f".{'ab' * 16}.tmp")
    return layout


def free_mib(layout: Layout) -> float:
    st = os.statvfs(layout.root)
    return st.f_bavail * st.f_frsize / MiB


def test_the_dry_run_plans_the_floor_pass_too(fs_layout: Layout) -> None:
    """Below the floor the real run's floor pass deletes from a scan of the disk first, then the
    regular plan runs on what is left: the dry run plans both, in that order."""
    free = free_mib(fs_layout)
    floor = free + 8  # 8 MiB short of it
    dry, real = dry_then_real(
        fs_layout, "--min-free-bytes", str(int(floor * MiB)), "--tmp-ttl", "1s"
    )
    reasons = [s["reason"] for s in real["steps"]]
    assert reasons[:2] == ["trash", "free_space"] and "tmp" in reasons[2:], real["steps"]
    assert free_mib(fs_layout) > floor, (free_mib(fs_layout), floor)
    assert dry["dry_run"] and not real["dry_run"]


def test_the_dry_run_lists_free_space_evictions_over_the_floor(fs_layout: Layout) -> None:
    """Over the floor but past its high watermark: the regular plan (no floor pass) evicts."""
    free = free_mib(fs_layout)
    _dry, real = dry_then_real(fs_layout, "--min-free-bytes", str(int((free - 1) * MiB)))
    assert real["by_reason"]["free_space"]["files"] > 0, real


def test_nothing_to_delete_is_nothing_in_both(layout: Layout) -> None:
    _bound(layout, "a", 2)
    dry, real = dry_then_real(layout)
    assert dry["files"] == real["files"] == 0


def test_the_dry_run_plans_the_cap_after_the_floor_pass(fs_layout: Layout) -> None:
    """The floor pass takes the oldest pages first; the cap's evictions after it are planned
    on what is left (not on pages the floor pass already took, nor their bytes)."""
    floor = free_mib(fs_layout) + 4
    b = _bound(fs_layout, "b", 0)
    fill(b, 6, start=100)  # newer than all of a's: the floor pass leaves them
    limits = ("--min-free-bytes", str(int(floor * MiB)), "--namespace-max-bytes", str(20 * MiB))
    _dry, real = dry_then_real(fs_layout, *limits)
    assert {"free_space", "cap"} <= set(real["by_reason"]), real["by_reason"]
