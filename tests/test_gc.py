"""GC planning and execution on real files and a real state DB, with injected clocks."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachemgr.daemon.events import LOCAL, Kind
from cachemgr.daemon.page_events import PageEvents
from cachemgr.gc import find as gcfind
from cachemgr.gc.check import needs_gc
from cachemgr.gc.execute import CHUNK, execute_gc
from cachemgr.gc.find import TrashCounts
from cachemgr.gc.runner import GcRunner
from cachemgr.state.index import scan_root
from cachemgr.state.store import Store
from tests.gc_helpers import NS, NS2, T0, Tree, big_disk, evicted, page, policy, temp

SYS = [page(i) for i in range(4)]
A = [page(100 + i) for i in range(6)]
B = [page(200 + i) for i in range(6)]
C = [page(300 + i) for i in range(6)]


@pytest.fixture
def tree(root: Path) -> Iterator[Tree]:
    t = Tree.at(root)
    yield t
    t.close()


def three_sessions(tree: Tree) -> None:
    """A wrote the system prompt and its turn first; B and C reused the system prompt later."""
    tree.write(NS, SYS + A, at=T0)
    tree.read(NS, SYS, at=T0 + 100)
    tree.write(NS, B, at=T0 + 100)
    tree.read(NS, SYS, at=T0 + 200)
    tree.write(NS, C, at=T0 + 200)


def test_chain_tails_go_before_heads(tree: Tree) -> None:
    three_sessions(tree)  # 22 pages of 1000 bytes
    plan = tree.plan(policy(max_bytes=20_000), now=T0 + 300)
    # over 95% of the cap: down to 85% = 17,000 bytes, so 5 pages go, A's tail first.
    # Plain LRU would take A[0..4] and strand A[5]: SGLang loads contiguous prefixes only.
    assert evicted(plan) == A[:0:-1]
    tree.execute(plan, now=T0 + 300)
    assert tree.files(NS) == {*SYS, A[0], *B, *C}


def test_pages_shared_by_many_sessions_go_last(tree: Tree) -> None:
    three_sessions(tree)
    plan = tree.plan(policy(max_bytes=8_000, high_watermark=0.95, low_watermark=0.5), now=T0 + 300)
    # 4,000 bytes may stay: the system prompt, read by every session, is what survives
    assert evicted(plan) == A[::-1] + B[::-1] + C[::-1]
    assert set(SYS).isdisjoint(evicted(plan))


def test_lru_order_survives_a_restart(tree: Tree, root: Path) -> None:
    three_sessions(tree)
    before = tree.plan(policy(max_bytes=15_000), now=T0 + 300)
    tree.store.close()
    reopened = Tree.at(root)
    try:
        assert evicted(reopened.plan(policy(max_bytes=15_000), now=T0 + 300)) == evicted(before)
        reopened.read(NS, A, at=T0 + 400)  # A is the newest again; its sequence keeps counting
        after = reopened.plan(policy(max_bytes=15_000), now=T0 + 500)
        assert set(A).isdisjoint(evicted(after))
        assert evicted(after)[:6] == B[::-1]
    finally:
        reopened.store.close()


def test_min_age_protects_recent_use_and_recent_files(tree: Tree) -> None:
    """A recent use puts a page last in the plan; a file modified since the index last heard
    of it is kept by the deletion's age check, but not against the cap that needs it (it
    said the cap held with one page too many)."""
    tree.write(NS, A, at=T0)
    tree.read(NS, A[:2], at=T0 + 990)  # read 10 s before "now": in use
    os.utime(tree.dir(NS) / A[5], (T0 + 995, T0 + 995))  # rewritten 5 s ago, index not told
    plan = tree.plan(policy(max_bytes=4_000, min_age=60), now=T0 + 1000)
    assert set(evicted(plan)) == set(A[3:]) and plan.overridden == 0
    report = tree.execute(plan, now=T0 + 1000)
    assert (report.steps[0].young, report.overridden, report.held) == (0, 1, True)
    assert tree.files(NS) == set(A[:3])


def test_min_age_yields_to_the_cap_when_nothing_else_is_left(tree: Tree) -> None:
    """A protection reorders victims; it never stops the cap: the young pages go last, in a
    step of their own without the age rule, and the plan counts them."""
    tree.write(NS, A, at=T0)
    tree.read(NS, A[:2], at=T0 + 990)
    plan = tree.plan(policy(max_bytes=1_000, min_age=60), now=T0 + 1000)
    assert evicted(plan) == [*A[2:][::-1], A[1], A[0]]  # tails first, the young last
    assert [(s.forced, s.min_age) for s in plan.steps] == [(False, 60), (True, 0.0)]
    assert plan.overridden == 2 and any("wins over their protection" in w for w in plan.warnings)
    tree.execute(plan, now=T0 + 1000)
    assert tree.files(NS) == set()


def test_stale_temps_go_after_tmp_ttl_and_fresh_ones_never(tree: Tree) -> None:
    tree.write(NS, A[:1], at=T0)
    d = tree.dir(NS)
    for name, mtime in [(temp(1), T0), (temp(2), T0 + 3000)]:
        (d / name).write_bytes(b"partial")
        os.utime(d / name, (mtime, mtime))
    pol = policy(tmp_ttl=3600)
    assert evicted(tree.plan(pol, now=T0 + 3599)) == []
    plan = tree.plan(pol, now=T0 + 3601)
    assert evicted(plan, "tmp") == [temp(1)]
    tree.execute(plan, now=T0 + 3601)
    assert tree.files(NS) == {A[0], temp(2)}
    assert evicted(tree.plan(pol, now=T0 + 6601)) == [temp(2)]


def test_what_is_not_an_sglang_file_is_never_deleted(tree: Tree, tmp_path: Path) -> None:
    outside = tmp_path / "precious.bin"
    outside.write_bytes(b"keep")
    d = tree.dir(NS)
    (d / page(1)).symlink_to(outside)
    (d / "notes.txt").write_text("mine")
    (d / page(2)).mkdir()
    (tree.layout.ns_root / page(3)).write_bytes(b"x" * 10)  # outside any namespace dir
    (tree.layout.root / page(4)).write_bytes(b"x" * 10)
    (tree.layout.trash / "0123456789abcdef.1").symlink_to(tmp_path)
    old = T0 - 86400
    for p in (d / "notes.txt", tree.layout.ns_root / page(3), tree.layout.root / page(4)):
        os.utime(p, (old, old))
    # A poisoned index that lists them all as old pages, and a cap that wants everything gone
    with tree.store.transaction() as conn:
        conn.executemany(
            "INSERT INTO pages (namespace_id, name, size, created_at, last_access, key_len)"
            " VALUES (?, ?, 10, ?, ?, ?)",
            [(NS, n, old, old, len(n)) for n in (page(1), "notes.txt", page(2))],
        )
    tree.write(NS, A[:1], at=old)
    plan = tree.plan(policy(max_bytes=1, min_free_percent=0), now=T0)
    gone: list[tuple[str, str]] = []
    report = tree.execute(
        plan, now=T0, recorded=lambda ns, names: gone.extend((ns, n) for n in names)
    )
    assert report.files == 1  # the one real page
    assert tree.files(NS) == {page(1), "notes.txt", page(2)}
    assert outside.read_bytes() == b"keep"
    assert (tree.layout.ns_root / page(3)).exists() and (tree.layout.root / page(4)).exists()
    assert (tree.layout.trash / "0123456789abcdef.1").is_symlink()
    assert len(report.steps[-1].refused) == 3
    # what the live chain model forgets at once: the page deleted, none of those refused
    assert gone == [(NS, A[0])]


def busy_root(tree: Tree) -> None:
    """Work for every reason: trash, a stale temp, an unbound namespace, a torn page, a cap."""
    trash = tree.layout.trash / f"{NS2}.purged"
    trash.mkdir()
    (trash / page(900)).write_bytes(b"t" * 700)
    tree.write(NS, SYS + A, at=T0)
    tree.write(NS, [page(50)], at=T0, size=400)  # torn: every other page is 1000 bytes
    (tree.dir(NS) / temp(7)).write_bytes(b"p" * 30)
    os.utime(tree.dir(NS) / temp(7), (T0, T0))
    tree.add_namespace(NS, active=T0, bound=True)
    tree.add_namespace(NS2, active=T0)
    tree.write(NS2, B, at=T0)


def test_dry_run_deletes_nothing_and_frees_what_the_real_run_frees(tree: Tree) -> None:
    busy_root(tree)
    pol = policy(max_bytes=6_000, keep_unbound=0, tmp_ttl=60)
    plan = tree.plan(pol, now=T0 + 100)
    # The limit first: a long drain must not hold it back (plan_gc)
    assert [s.reason for s in plan.steps] == ["cap", "trash", "tmp", "unbound", "corrupt"]
    listing = sorted(os.walk(tree.layout.root))
    gone: dict[bool, list[str]] = {True: [], False: []}  # what each run recorded gone
    dry = tree.execute(plan, now=T0 + 100, dry_run=True, recorded=lambda _, n: gone[True].extend(n))
    assert sorted(os.walk(tree.layout.root)) == listing
    assert tree.plan(pol, now=T0 + 100) == plan  # a dry run changes nothing, not even the index
    real = tree.execute(plan, now=T0 + 100, recorded=lambda _, n: gone[False].extend(n))
    assert dry.bytes == real.bytes == plan.bytes
    assert dry.totals() == real.totals() == plan.totals()
    cap = real.steps[0]
    assert gone[True] == [] and len(gone[False]) == cap.files > 0
    assert not (tree.layout.trash / f"{NS2}.purged").exists()
    assert not tree.layout.ns_dir(NS2).exists()
    state = tree.store.conn.execute("SELECT state FROM namespaces WHERE id = ?", (NS2,))
    assert state.fetchone()[0] == "purged"


def test_every_deletion_is_audited_once_per_namespace_and_reason(tree: Tree) -> None:
    busy_root(tree)
    plan = tree.plan(policy(max_bytes=6_000, keep_unbound=0, tmp_ttl=60), now=T0 + 100)
    tree.execute(plan, now=T0 + 100)
    rows = tree.store.conn.execute(
        "SELECT action, namespace_id, reason, actor, pages, bytes FROM audit ORDER BY id"
    ).fetchall()
    assert [tuple(r) for r in rows] == [
        ("evict", NS, "cap", "cli", 5, 5000),
        ("delete-trash", NS2, "trash", "cli", 1, 700),
        ("evict", NS, "tmp", "cli", 1, 30),
        ("evict", NS2, "unbound", "cli", 6, 6000),
        ("evict", NS, "corrupt", "cli", 1, 400),
    ]


def test_unbound_namespaces_go_oldest_first_past_retention(tree: Tree) -> None:
    ids = [f"{i:016x}" for i in range(1, 6)]
    for age, ns in enumerate(ids):  # ids[0] is the newest
        tree.add_namespace(ns, active=T0 - 1000 * age, bound=(ns == ids[4]))
        tree.write(ns, [page(age)], at=T0 - 1000 * age)
    plan = tree.plan(policy(keep_unbound=2), now=T0)
    assert [(s.namespace_id, s.reason) for s in plan.steps] == [
        (ids[3], "unbound"),
        (ids[2], "unbound"),
    ]  # ids[4] is bound: never dropped, whatever its age
    plan = tree.plan(policy(keep_unbound=2, unbound_ttl=1500), now=T0)
    assert [(s.namespace_id, s.reason) for s in plan.steps] == [
        (ids[3], "ttl"),
        (ids[2], "ttl"),
    ]
    assert tree.plan(policy(keep_unbound=0, min_age=5000), now=T0).steps == ()


def test_torn_pages_are_found_per_kind(tree: Tree) -> None:
    tree.write(NS, [page(i) for i in range(5)], at=T0, size=1024)
    tree.write(NS, [page(i, pool="mamba") for i in range(5)], at=T0, size=300)
    tree.write(NS, [page(9)], at=T0, size=512)
    tree.write(NS2, [page(i) for i in range(2)], at=T0, size=1024)
    tree.write(NS2, [page(i + 2) for i in range(2)], at=T0, size=512)
    plan = tree.plan(policy(), now=T0 + 1)
    assert [(s.namespace_id, s.names) for s in plan.steps] == [(NS, (page(9),))]
    assert plan.warnings == (f"ns/{NS2}: pages *_m_0_1.bin have mixed sizes; none removed",)


def test_free_space_floor_evicts_like_a_cap(tree: Tree) -> None:
    tree.write(NS, A + B, at=T0)  # 12,000 bytes
    # 100 kB disk, 3 kB free, 10% must stay free: the cache may use 12,000 + 3,000 - 10,000
    plan = tree.plan(
        policy(min_free_percent=10), now=T0 + 1, disk_usage=lambda _: (100_000, 0, 3_000)
    )
    assert plan.budget_bytes == 5_000
    assert plan.totals() == {"free_space": (8, 8_000)}  # down to 85% of 5,000


def test_namespace_cap_touches_only_that_namespace(tree: Tree) -> None:
    tree.write(NS, A + B, at=T0)
    tree.write(NS2, C[:3], at=T0 - 100)  # older, but under its own cap
    plan = tree.plan(policy(namespace_max_bytes=5_000), now=T0 + 1)
    assert [(s.namespace_id, s.reason, len(s.names)) for s in plan.steps] == [(NS, "cap", 8)]


def test_needs_gc_reads_aggregates_that_follow_the_index(tree: Tree) -> None:
    tree.write(NS, A, at=T0)
    tree.write(NS2, B[:2], at=T0, size=300)
    pol = policy(max_bytes=6_000)
    kw = {"now": T0 + 1, "disk_usage": lambda _: (10**12, 0, 10**12)}
    assert needs_gc(tree.layout, tree.store, pol, **kw) == ("cap",)
    tree.execute(tree.plan(pol, now=T0 + 1), now=T0 + 1)
    assert needs_gc(tree.layout, tree.store, pol, **kw) == ()
    tree.write(NS, [A[0]], at=T0 + 2, size=5000)  # rewritten bigger: the resize trigger
    (tree.layout.trash / f"{NS2}.x").mkdir()
    assert needs_gc(tree.layout, tree.store, pol, **kw) == ("trash", "cap")
    sums = "SELECT namespace_id, COUNT(*), SUM(size) FROM pages GROUP BY namespace_id"
    usage = "SELECT namespace_id, pages, bytes FROM namespace_stats WHERE pages > 0 ORDER BY 1"
    conn = tree.store.conn
    assert [tuple(r) for r in conn.execute(sums)] == [tuple(r) for r in conn.execute(usage)]


def test_scan_brings_the_index_in_line_and_keeps_recency(tree: Tree) -> None:
    """The CLI's no-daemon scan: new pages added, gone ones removed, known ones keep their
    last access, reads and access order (GC evicts by them)."""
    tree.write(NS, A, at=T0)
    tree.read(NS, A[2:4], at=T0 + 3)
    before = {
        r[0]: tuple(r[1:])
        for r in tree.store.conn.execute("SELECT name, last_access, reads, access_seq FROM pages")
    }
    (tree.dir(NS) / A[0]).unlink()
    (tree.dir(NS) / page(77)).write_bytes(b"n" * 1000)
    (tree.dir(NS) / A[1]).write_bytes(b"n" * 10)
    tree.write(NS2, B, at=T0)
    for name in B:
        (tree.dir(NS2) / name).unlink()
    tree.dir(NS2).rmdir()
    reports = scan_root(tree.layout, tree.store, now=lambda: T0 + 5)
    assert [(r.namespace_id, r.added, r.removed) for r in reports] == [(NS, 1, 1)]
    rows = tree.store.conn.execute("SELECT name, last_access, reads, access_seq, size FROM pages")
    got = {r[0]: tuple(r[1:]) for r in rows}
    assert sorted(got) == sorted([*A[1:], page(77)])
    for name in A[1:]:
        assert got[name][:3] == before[name]
    assert got[A[1]][3] == 10  # resized
    assert got[A[2]][1:3] == (1, before[A[2]][2]) and before[A[2]][2] > 0


def test_event_sequence_follows_observation_order_and_resumes(tree: Tree) -> None:
    tree.write(NS, A, at=T0)
    tree.rec.apply(
        [(Kind.READ, NS, A[3], 0.0, LOCAL), (Kind.READ, NS, A[1], 0.0, LOCAL)], now=T0 + 1
    )
    seqs = dict(tree.store.conn.execute("SELECT name, access_seq FROM pages"))
    assert seqs[A[0]] < seqs[A[2]] < seqs[A[3]] < seqs[A[1]]  # one counter, event order
    again = PageEvents(tree.layout, Store.open(tree.layout.db_path))
    again.apply([(Kind.READ, NS, A[0], 0.0, LOCAL)], now=T0 + 2)
    seqs = dict(tree.store.conn.execute("SELECT name, access_seq FROM pages"))
    assert seqs[A[0]] > max(seqs[n] for n in A[1:])
    again.store.close()


def test_a_stop_ends_the_run_after_the_chunk_being_deleted(tree: Tree) -> None:
    """Daemon shutdown: GC finishes the chunk it is deleting (index and audit agree), no more."""
    names = [page(i) for i in range(5000)]
    tree.write(NS, names, at=T0, size=10)
    plan = tree.plan(policy(max_bytes=1), now=T0 + 1)
    checks = iter([False, False])  # the step, then its first chunk; stop after that
    report = execute_gc(plan, tree.run(clock=lambda: T0 + 1, stop=lambda: next(checks, True)))
    (step,) = report.steps
    assert step.files == CHUNK and step.skipped and step.skipped.startswith("stopped")
    assert len(tree.files(NS)) == 5000 - CHUNK
    (left,) = tree.store.conn.execute("SELECT COUNT(*) FROM pages").fetchone()
    assert left == 5000 - CHUNK
    audited = tree.store.conn.execute("SELECT SUM(pages) FROM audit WHERE action = 'evict'")
    assert audited.fetchone()[0] == CHUNK


def test_a_namespace_dir_turned_symlink_is_skipped_and_gc_goes_on(
    tree: Tree, tmp_path: Path
) -> None:
    """An unbound namespace past retention whose dir is now a symlink: a warning, not a failed
    run, and nothing behind the symlink is touched; the cap is still enforced."""
    busy_root(tree)
    elsewhere = tmp_path / "elsewhere"
    tree.layout.ns_dir(NS2).rename(elsewhere)
    tree.layout.ns_dir(NS2).symlink_to(elsewhere)
    plan = tree.plan(policy(max_bytes=6_000, keep_unbound=0, tmp_ttl=60), now=T0 + 100)
    assert [s.reason for s in plan.steps] == ["cap", "trash", "tmp", "corrupt"]
    left = [w for w in plan.warnings if w.startswith(f"ns/{NS2} left alone (unsafe):")]
    assert left and "symlink" in left[0]
    tree.execute(plan, now=T0 + 100)
    assert sorted(os.listdir(elsewhere)) == sorted(B)


def test_a_bound_namespace_dir_turned_symlink_fails_its_step_not_the_run(
    tree: Tree, tmp_path: Path
) -> None:
    tree.add_namespace(NS, active=T0, bound=True)
    tree.add_namespace(NS2, active=T0, bound=True)
    tree.write(NS, A, at=T0)
    tree.write(NS2, B, at=T0)
    plan = tree.plan(policy(namespace_max_bytes=2_000), now=T0 + 100)
    assert {s.namespace_id for s in plan.steps} == {NS, NS2}
    elsewhere = tmp_path / "elsewhere"
    tree.layout.ns_dir(NS).rename(elsewhere)
    tree.layout.ns_dir(NS).symlink_to(elsewhere)
    report = tree.execute(plan, now=T0 + 100)
    (refused,) = [s for s in report.steps if s.namespace_id == NS]
    assert refused.skipped is not None and "symlink" in refused.skipped
    assert sorted(os.listdir(elsewhere)) == sorted(A)  # nothing behind the symlink touched
    assert len(tree.files(NS2)) * 1000 <= 2_000  # the other namespace still brought under its cap


def test_a_trash_entry_is_counted_once_and_then_less_what_runs_drained(tree: Tree) -> None:
    """The daemon's runs plan again at once when they yield to a limit: a listing of every
    trash file at each plan took 7 s at 200,000 files. An entry is scanned once."""
    entry = tree.layout.trash / f"{NS2}.purged"
    entry.mkdir()
    for i in range(5):
        (entry / page(900 + i)).write_bytes(b"t" * 700)
    (entry / "notes.txt").write_text("mine")  # foreign: left, and said at every plan
    counts = TrashCounts()
    (step,) = gcfind.trash_leftovers(tree.layout, warnings := [], counts)
    assert (step.files, step.bytes, step.names, step.remove_dir) == (5, 3500, (), True)
    assert warnings == [
        f".trash/{entry.name}: left for a person: 1 foreign file, e.g. {entry}/notes.txt"
    ]
    (entry / page(900)).unlink()  # what a run drained: known from its report, not a scan
    counts.drained(entry.name, 1, 700)
    (entry / page(901)).unlink()  # (another process's drain: not seen until it is gone)
    (step,) = gcfind.trash_leftovers(tree.layout, warnings := [], counts)
    assert (step.files, step.bytes) == (4, 2800) and len(warnings) == 1
    assert [s.files for s in gcfind.trash_leftovers(tree.layout, [])] == [3]  # no counts: scans
    shutil.rmtree(entry)
    assert gcfind.trash_leftovers(tree.layout, [], counts) == []
    entry.mkdir()  # (a name never comes back: `counts` forgot it with its entry)
    assert [s.files for s in gcfind.trash_leftovers(tree.layout, [], counts)] == [0]


def test_a_crossed_limit_is_held_before_a_due_sweep_lists_the_dirs(tree: Tree) -> None:
    """A sweep lists every namespace dir before its plan is made (64 s at 10M pages, while a
    restarted daemon's cap waited): a tick with both due holds the limit in a run without
    the sweep, and the next tick sweeps, the limit crossed again or not."""
    tree.write(NS, [page(i) for i in range(10)], at=T0)
    d = tree.dir(NS)
    (d / temp(1)).write_bytes(b"partial")
    os.utime(d / temp(1), (T0, T0))
    pol = policy(max_bytes=6_000, tmp_ttl=60)
    runner = GcRunner(tree.layout, tree.store, pol, disk_usage=big_disk, clock=lambda: T0 + 100)
    try:
        first = runner.tick()
        assert first is not None and first.totals().keys() == {"cap"}
        assert temp(1) in tree.files(NS) and runner.last_sweep < 0
        tree.write(NS, [page(i) for i in range(10, 14)], at=T0 + 50)  # over the cap again
        second = runner.tick()
        assert second is not None and second.totals().keys() == {"cap", "tmp"}
        assert temp(1) not in tree.files(NS) and runner.last_sweep == T0 + 100
    finally:
        runner.leadership.release()
