"""A limit GC cannot hold with what it may delete is no `ok` run: the plan says which limit and
how much more would have to go, `cachemgr gc` exits 1, the daemon counts the run `short`, its
metric and /v1/status name the limit, and doctor reports it. Real files, a real state DB, the
real daemon on a loopback port."""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from cachemgr.daemon.metrics import CachemgrCollector, Parts
from cachemgr.fs.leadership import Leadership
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.floor import free_floor
from cachemgr.gc.runner import GcRunner
from cachemgr.gc.step import GcReport, Unmet, joined
from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from tests.daemon_helpers import NS_A, LogLines, captured_log, running_daemon
from tests.gc_helpers import NS, NS2, T0, Tree, page, page_bytes, policy
from tests.nsfixtures import cli
from tests.polling import wait_for
from tests.test_gc_file_caps import PAGES, full  # noqa: F401 (a fixture)
from tests.test_gc_refusals import immutable

A = [page(100 + i) for i in range(6)]
B = [page(200 + i) for i in range(6)]


@pytest.fixture
def tree(root: Path) -> Iterator[Tree]:
    t = Tree.at(root)
    yield t
    t.close()


def _disk(free: int) -> object:
    """A 100 kB filesystem with `free` bytes free."""
    return lambda _: (100_000, 100_000 - free, free)


def test_a_floor_the_filesystem_cannot_meet_even_with_no_cache_is_unmet(tree: Tree) -> None:
    tree.write(NS, A + B, at=T0)  # 12,000 bytes
    # 3 kB free and half the disk must be: even with all 12 kB gone, 35 kB are missing.
    plan = tree.plan(policy(min_free_percent=50), now=T0 + 1, disk_usage=_disk(3_000))
    assert plan.totals() == {"free_space": (12, 12_000)}  # it still takes all it may
    assert plan.unmet == (Unmet("free_space", None, "bytes", 35_000),)
    assert plan.unmet[0].line() in plan.warnings
    assert "free-space floor is not held" in plan.unmet[0].line()
    assert "35.0 kB more would have to go" in plan.unmet[0].line()
    report = tree.execute(plan, now=T0 + 1)
    assert not report.held and report.unmet == plan.unmet
    assert report.files == 12


def test_a_run_that_does_not_hold_a_limit_says_so_at_warning(tree: Tree) -> None:
    """Its `gc done` line was INFO (only files kept made it a warning): a run short of a
    limit read in the log as one that did its job (docs/gc.md says a warning)."""
    tree.write(NS, A + B, at=T0)
    plan = tree.plan(policy(min_free_percent=50), now=T0 + 1, disk_usage=_disk(3_000))
    with captured_log("cachemgr.gc.execute") as log:
        report = tree.execute(plan, now=T0 + 1)
    assert not report.held
    (done,) = [r for r in log.lines if r["msg"] == "gc done"]
    assert done["level"] == "warning" and done["held"] is False, done


def test_a_floor_pass_that_cannot_meet_the_floor_is_not_held(tree: Tree) -> None:
    """The pass from a scan of the disk said `"held": true` every 5 s while
    cachemgr_gc_limits_unmet was 1: its shortfall was a warning string, never an Unmet."""
    tree.write(NS, A + B, at=T0)
    with captured_log("cachemgr.gc.floor") as log:
        report = free_floor(
            tree.layout, policy(min_free_percent=50), disk_usage=_disk(3_000), clock=lambda: T0 + 1
        )
    assert report.files == 12  # it still takes all it may
    assert not report.held
    assert [(u.reason, u.namespace_id, u.unit) for u in report.unmet] == [
        ("free_space", None, "bytes")
    ]
    (said,) = [r for r in log.lines if str(r["msg"]).startswith("deleted from a scan")]
    assert said["held"] is False, said


def test_a_floor_pass_and_the_run_after_it_name_an_unmet_floor_once(tree: Tree) -> None:
    """Both plan the floor: joined, the run's word stands (the gauge counts each Unmet)."""
    floor = GcReport(False, True, T0, T0, unmet=(Unmet("free_space", None, "bytes", 9),))
    run = GcReport(False, True, T0, T0, unmet=(Unmet("free_space", None, "bytes", 5),))
    assert joined(floor, run).unmet == run.unmet
    assert joined(floor, GcReport(False, True, T0, T0)).unmet == floor.unmet


def test_a_floor_met_by_evicting_is_held(tree: Tree) -> None:
    """The same disk with a floor the cache's own pages can meet: no unmet limit."""
    tree.write(NS, A + B, at=T0)
    # 10% of 100 kB: the cache may use 12,000 + 3,000 - 10,000 = 5,000 bytes.
    plan = tree.plan(policy(min_free_percent=10), now=T0 + 1, disk_usage=_disk(3_000))
    assert plan.totals() == {"free_space": (8, 8_000)}
    assert plan.unmet == ()
    assert tree.execute(plan, now=T0 + 1).held


def _damaged(tree: Tree) -> None:
    """NS's 12 pages (12 kB) left alone (a bad manifest), NS2's 6 (6 kB) live."""
    tree.write(NS, A + B, at=T0)
    tree.write(NS2, A, at=T0)
    (tree.layout.ns_root / f"{NS}.json").write_text("{not json")


def test_a_damaged_namespace_filling_the_disk_is_no_free_space(tree: Tree) -> None:
    """A namespace left alone keeps its 12 kB on the disk: they are neither free space to come
    nor no one's. Below the floor, the live namespace's pages all go, and the floor is unmet
    (counted as free space, they hid it: nothing planned, the run `ok`)."""
    _damaged(tree)
    # 10% of 100 kB must stay free, 3 kB are: NS2's 6 kB are not enough.
    plan = tree.plan(policy(min_free_percent=10), now=T0 + 1, disk_usage=_disk(3_000))
    assert plan.totals() == {"free_space": (6, 6_000)}
    assert {s.namespace_id for s in plan.steps} == {NS2}
    # The budget is 18 + 3 - 10 = 11 kB, its low watermark 9,350 bytes; 12 kB stay.
    assert plan.unmet == (Unmet("free_space", None, "bytes", 12_000 - 9_350),)


def test_a_damaged_namespace_counts_under_the_root_cap(tree: Tree) -> None:
    """18 kB under a 15 kB cap, 12 kB of them left alone: the live pages make room (as the
    cheap check, which counts every namespace, asked for); under a 12 kB cap they all go and
    the cap is unmet, not a run `ok` with the cap exceeded."""
    _damaged(tree)
    plan = tree.plan(policy(max_bytes=15_000), now=T0 + 1)
    assert plan.totals() == {"cap": (6, 6_000)} and plan.unmet == ()
    plan = tree.plan(policy(max_bytes=12_000), now=T0 + 1)
    assert plan.totals() == {"cap": (6, 6_000)}
    assert plan.unmet == (Unmet("cap", None, "bytes", 12_000 - 10_200),)


def test_a_damaged_namespace_over_its_own_cap_is_unmet(tree: Tree) -> None:
    """A namespace left alone over the namespace cap: none of its pages may go, so its cap is
    unmet by name; the live one under it is left be."""
    _damaged(tree)
    plan = tree.plan(policy(namespace_max_bytes=10_000), now=T0 + 1)
    assert plan.steps == ()
    assert plan.unmet == (Unmet("cap", NS, "bytes", 12_000 - 8_500),)


def test_a_damaged_namespace_counts_under_the_file_caps(tree: Tree) -> None:
    """The same in files: 18 page files under a root cap of 15, 12 of them left alone, make
    the live ones go; under 12 they all go and the cap is unmet; a damaged namespace over the
    namespace file cap is unmet by name (the cheap check counted them all, the plan none)."""
    _damaged(tree)
    plan = tree.plan(policy(max_files=15), now=T0 + 1)
    assert plan.totals() == {"files": (6, 6_000)} and plan.unmet == ()
    plan = tree.plan(policy(max_files=12), now=T0 + 1)
    assert plan.totals() == {"files": (6, 6_000)}
    assert plan.unmet == (Unmet("files", None, "files", 12 - 10),)
    plan = tree.plan(policy(namespace_max_files=10), now=T0 + 1)
    assert plan.steps == ()
    assert plan.unmet == (Unmet("files", NS, "files", 12 - 8),)


def test_an_unmet_limit_clears_once_it_is_no_longer_crossed(tree: Tree) -> None:
    """The daemon's tick: a floor out of reach is unmet; once space is freed beside the cache
    the next tick finds nothing crossed and runs nothing, and the limit is no longer unmet
    (else the gauge, and its alert, would stay up for good); nor once another process leads."""
    tree.write(NS, A, at=T0)
    free = [3_000]
    runner = GcRunner(
        tree.layout,
        tree.store,
        policy(min_free_percent=50),
        clock=lambda: T0 + 1,
        disk_usage=lambda _: (100_000, 100_000 - free[0], free[0]),
    )
    runner.last_sweep = T0 + 1  # (no sweep due: this is about the limits)
    try:
        report = runner.tick()
        assert report is not None and not report.held
        assert [u.reason for u in runner.stats.unmet] == ["free_space"]
        # (the floor pass and the run after it: one run, short)
        assert runner.stats.short == 1 and runner.stats.ok == 0
        free[0] = 90_000  # someone deleted their files: the floor holds with room to spare
        assert runner.tick() is None
        assert runner.stats.unmet == ()
        free[0] = 3_000
        runner.tick()
        assert runner.stats.unmet != ()
    finally:
        runner.leadership.release()
    # Another process leads now: this one's last word on the limits is void.
    other = Leadership(tree.layout.gc_lock)
    assert other.try_acquire()
    try:
        assert runner.tick() is None and runner.stats.skipped == 1
        assert runner.stats.unmet == ()
    finally:
        other.release()


def _runs(runner: GcRunner) -> Callable[[str], float | None]:
    """cachemgr_gc_runs_total by result, as the daemon's collector says it of `runner`."""

    @contextmanager
    def reader() -> Iterator[sqlite3.Connection]:
        yield runner.store.conn

    reg = CollectorRegistry(auto_describe=False)
    reg.register(CachemgrCollector(runner.layout, reader, Parts(gc=runner)))
    return lambda result: reg.get_sample_value("cachemgr_gc_runs_total", {"result": result})


def _floor_passes(log: LogLines) -> int:
    return sum(r["msg"].startswith("deleted from a scan of the disk") for r in log.lines)


def test_a_tick_below_an_unmet_floor_is_one_pass_and_one_short_run(tree: Tree) -> None:
    """A tick's floor pass and the run after it are one run: the run started with a second
    pass (every namespace dir listed again, the floor still unmet), and the tick counted 3
    `short` runs: each pass alone, then the two joined with the run's plan."""
    tree.write(NS, A + B, at=T0)
    runner = GcRunner(
        tree.layout,
        tree.store,
        policy(min_free_percent=50),
        clock=lambda: T0 + 1,
        disk_usage=_disk(3_000),
    )
    runner.last_sweep = T0 + 1  # (no sweep due: this is about the floor)
    runs = _runs(runner)
    try:
        with captured_log("cachemgr.gc.floor") as log:
            report = runner.tick()
        assert report is not None and not report.held and report.files == 12
        assert _floor_passes(log) == 1
        assert (runs("short"), runs("ok"), runs("error")) == (1, 0, 0)
        with captured_log("cachemgr.gc.floor") as log:
            runner.tick()  # nothing left to delete: still one pass, one run
        assert _floor_passes(log) == 1
        assert (runs("short"), runs("ok")) == (2, 0)
    finally:
        runner.leadership.release()


def test_a_run_that_ends_between_the_watermarks_holds_its_limit(tree: Tree) -> None:
    """Under the high watermark but over the low one (the rest protected or not indexed): GC
    freed less than it aimed to, and the limit held."""
    tree.write(NS, A, at=T0)
    # A live model that knows only the first 6 pages: the other 6 cannot be planned.
    model = ChainModel.from_index(tree.store.conn, [NS])
    tree.write(NS, B, at=T0)
    plan = tree.plan(
        policy(max_bytes=7_000, high_watermark=0.95, low_watermark=0.5), now=T0 + 1, model=model
    )
    assert plan.totals() == {"cap": (6, 6_000)}  # all it knows; 6,000 left of a 7,000 cap
    assert any("still over the low watermark" in w for w in plan.warnings)
    assert plan.unmet == ()


def test_a_namespace_cap_whose_pages_the_model_does_not_hold_is_unmet(tree: Tree) -> None:
    """A namespace over its cap whose pages no order can offer (the daemon's model has not
    learned them): the cap is not held, and the plan names the namespace."""
    tree.write(NS, A + B, at=T0)
    tree.write(NS2, A[:2], at=T0)
    empty = ChainModel.from_index(tree.store.conn, [])
    plan = tree.plan(policy(namespace_max_bytes=5_000), now=T0 + 1, model=empty)
    assert plan.steps == ()
    assert plan.unmet == (Unmet("cap", NS, "bytes", 12_000 - math.floor(5_000 * 0.85)),)
    assert f"ns/{NS}'s byte cap is not held" in plan.warnings[-1]


def test_cli_gc_exits_1_when_the_floor_cannot_be_held(
    full: Layout,  # noqa: F811 (the fixture imported above)
) -> None:
    """No filesystem has 99.99% free with a cache on it: every page goes, and the run says
    the floor was not held (exit 1, one line, `held: false` and the limit in the JSON)."""
    args = ("--root", str(full.root), "gc", "--json", "--min-free-percent", "99.99")
    preview = cli(*args, "--dry-run")
    assert preview.returncode == 0, preview.stderr  # a dry run only reports
    assert json.loads(preview.stdout)["unmet"][0]["limit"] == "free_space"
    assert len(list(full.ns_dir(NS_A).glob("*.bin"))) == PAGES
    out = cli(*args, "--yes", env={"CACHEMGR_GC_MIN_AGE": "0"})
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("cachemgr: error: the limit was not held: free_space still over")
    assert "Traceback" not in out.stderr
    report = json.loads(out.stdout)
    assert not report["held"]
    assert [(u["limit"], u["namespace_id"], u["unit"]) for u in report["unmet"]] == [
        ("free_space", None, "bytes")
    ]
    assert report["unmet"][0]["excess"] > 0
    assert list(full.ns_dir(NS_A).glob("*.bin")) == []


def _unmet(text: str) -> dict[str, float]:
    families = text_string_to_metric_families(text)
    return {
        s.labels["limit"]: s.value
        for f in families
        if f.name == "cachemgr_gc_limits_unmet"
        for s in f.samples
    }


def test_the_daemon_says_it_cannot_hold_the_floor(
    full: Layout,  # noqa: F811 (the fixture imported above)
) -> None:
    """A daemon whose free-space floor no filesystem meets: GC deletes every page, its runs
    count `short`, `cachemgr_gc_limits_unmet{limit="free_space"}` is 1, /v1/status lists the
    limit and doctor reports it as an error."""
    settings = load_settings(
        root=full.root, gc_interval=3600, gc_min_age=0, gc_min_free_percent=99.99
    )
    with running_daemon(settings) as dm:
        wait_for(lambda: _unmet(dm.get("/metrics").text).get("free_space"), timeout=30)
        metrics = dm.get("/metrics").text
        assert _unmet(metrics) == {
            "cap": 0,
            "dir_full": 0,
            "files": 0,
            "free_inodes": 0,
            "free_space": 1,
        }
        assert 'cachemgr_gc_runs_total{result="short"}' in metrics
        short = [
            s.value
            for f in text_string_to_metric_families(metrics)
            if f.name == "cachemgr_gc_runs"
            for s in f.samples
            if s.labels.get("result") == "short"
        ]
        assert short and short[0] >= 1
        (unmet,) = dm.status()["gc_unmet"]
        assert unmet["limit"] == "free_space" and unmet["namespace_id"] is None
        assert "free-space floor is not held" in unmet["message"]
        assert list(full.ns_dir(NS_A).glob("*.bin")) == []
        env = {"CACHEMGR_PORT": str(dm.daemon.port)}
        doc = cli("--root", str(full.root), "doctor", "--json", env=env)
        findings = json.loads(doc.stdout)
        codes = [f["code"] for f in findings]
        assert "gc-limit-not-held" in codes, doc.stdout
        (held,) = [f for f in findings if f["code"] == "gc-limit-not-held"]
        assert held["severity"] == "error" and "free space outside the cache" in held["fix"]
        assert doc.returncode == 2


@pytest.mark.parametrize("refused", [False, True])
def test_a_tick_whose_floor_pass_was_all_it_did_counts_it_once(tree: Tree, refused: bool) -> None:
    """Nothing crossed after the pass: the pass was the tick's run, counted once: `ok`, or
    `short` when the kernel refused it a page and the rest held the floor, and then
    `cachemgr_gc_last_success_timestamp_seconds` stays where it was (it moved on, so an alert
    on its age never fired while every pass fell short)."""
    tree.write(NS, A + B, at=T0)

    def disk(_: Path) -> tuple[int, int, int]:  # 3 kB free, and what the pass frees
        free = 3_000 + 12_000 - page_bytes(tree.dir(NS))
        return 100_000, 100_000 - free, free

    runner = GcRunner(
        tree.layout, tree.store, policy(min_free_bytes=4_000), clock=lambda: T0 + 1, disk_usage=disk
    )
    runner.last_sweep = T0 + 1
    runner.stats.last_success = before = T0 - 100
    runs = _runs(runner)
    try:
        with immutable(tree.dir(NS) / A[0]) if refused else nullcontext():
            report = runner.tick()
        assert report is not None and report.held is not refused and report.files > 0
        assert not runner.needs_gc()  # the pass held the floor: nothing crossed after it
        assert (runs("ok"), runs("short")) == ((0, 1) if refused else (1, 0))
        assert (runner.stats.last_success == before) is refused
    finally:
        runner.leadership.release()
