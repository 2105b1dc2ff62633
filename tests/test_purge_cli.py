"""`cachemgr purge` and `cachemgr ls` as an operator meets them: real processes, real trees."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cachemgr.cli import common
from cachemgr.fs import deletion
from cachemgr.layout import Layout
from cachemgr.ns import trash
from cachemgr.settings import Settings
from cachemgr.state import store as store_module
from cachemgr.state.store import Store
from tests.daemon_helpers import running_daemon
from tests.locks import ForeignLock, cli_here
from tests.nsfixtures import (
    PAGE_BYTES,
    audit_rows,
    cli,
    make_ns,
    one_line_error,
    page_name,
    snapshot,
)
from tests.polling import wait_for


def test_purge_without_yes_and_no_terminal_refuses(layout: Layout, store: Store) -> None:
    ns = make_ns(layout, store, "a")
    out = cli("--root", str(layout.root), "purge", "--namespace", ns)
    assert "--yes" in one_line_error(out)
    assert len(os.listdir(layout.ns_dir(ns))) == 3


def test_dry_run_prints_the_plan_and_deletes_nothing(layout: Layout, store: Store) -> None:
    a = make_ns(layout, store, "a", pages=3, instance="srv")
    b = make_ns(layout, store, "b", pages=2)
    before = snapshot(layout.root / "ns")
    out = cli("--root", str(layout.root), "purge", "--all", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert f"would purge ns {a} (3 pages, 300 B): bound to srv, recreated empty" in out.stdout
    assert f"would purge ns {b} (2 pages, 200 B): unbound" in out.stdout
    assert snapshot(layout.root / "ns") == before
    js = cli("--root", str(layout.root), "purge", "--all", "--dry-run", "--json")
    plan = json.loads(js.stdout)["plan"]
    assert {t["ns_id"]: t["pages"] for t in plan["targets"]} == {a: 3, b: 2}


def test_purge_yes_deletes_and_reports(layout: Layout, store: Store) -> None:
    a = make_ns(layout, store, "a", pages=3, instance="srv")
    b = make_ns(layout, store, "b", pages=2)
    keep = snapshot(layout.ns_dir(a))
    out = cli("--root", str(layout.root), "purge", "--unbound", "--yes", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert [p["ns_id"] for p in got["result"]["purged"]] == [b]
    assert got["deleted"]["files"] == 2
    assert not layout.ns_dir(b).exists() and os.listdir(layout.trash) == []
    assert snapshot(layout.ns_dir(a)) == keep


def test_ls_json_and_table(layout: Layout, store: Store) -> None:
    a = make_ns(layout, store, "a", pages=3, instance="srv")
    b = make_ns(layout, store, "b", pages=1, kv="fp8_e4m3")
    (layout.ns_root / ("c" * 16)).mkdir()  # a dir nobody registered
    out = cli("--root", str(layout.root), "ls", "--json")
    assert out.returncode == 0, out.stderr
    rows = {n["ns_id"]: n for n in json.loads(out.stdout)["namespaces"]}
    assert rows[a]["instances"] == ["srv"] and rows[a]["state"] == "bound"
    assert (rows[a]["pages"], rows[a]["bytes"], rows[a]["page_size"]) == (3, 300, 64)
    assert rows[b]["state"] == "unbound" and rows[b]["kv_cache_dtype"] == "fp8_e4m3"
    assert rows["c" * 16]["state"] == "no-manifest"
    table = cli("--root", str(layout.root), "ls", "--wide")
    assert table.returncode == 0, table.stderr
    assert a in table.stdout and "fp8_e4m3" in table.stdout and "300 B" in table.stdout


def test_ls_on_a_missing_root_is_one_line(tmp_path: Path) -> None:
    out = cli("--root", str(tmp_path / "nope"), "ls")
    assert "no cache root" in one_line_error(out)
    assert not (tmp_path / "nope").exists()


@pytest.mark.parametrize("bad", ["../../etc", "a/b", ".."])
def test_hostile_namespace_id_is_one_line(layout: Layout, bad: str) -> None:
    out = cli("--root", str(layout.root), "purge", "--namespace", bad, "--yes")
    assert out.returncode == 2
    assert "not a namespace id" in one_line_error(out)


def test_symlink_root_is_refused(tmp_path: Path, layout: Layout, store: Store) -> None:
    make_ns(layout, store, "a")
    link = tmp_path / "link"
    link.symlink_to(layout.root)
    before = snapshot(layout.root / "ns")
    for args in (["purge", "--all", "--yes"], ["ls"]):
        out = cli("--root", str(link), *args)
        assert "is a symlink" in one_line_error(out)
    assert snapshot(layout.root / "ns") == before


def test_root_that_cannot_exist_is_refused(tmp_path: Path) -> None:
    # Tests run as root, so permissions cannot stop us; a regular file as parent does.
    (tmp_path / "file").write_text("not a dir")
    for args in (["purge", "--all", "--yes"], ["ls"]):
        out = cli("--root", str(tmp_path / "file" / "root"), *args)
        one_line_error(out)
    assert (tmp_path / "file").read_text() == "not a dir"


def test_symlink_inside_namespace_fails_loudly_and_spares_the_target(
    layout: Layout, store: Store, tmp_path: Path
) -> None:
    ns = make_ns(layout, store, "a", pages=2)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"precious")
    (layout.ns_dir(ns) / page_name(7)).symlink_to(outside)
    out = cli("--root", str(layout.root), "purge", "--namespace", ns, "--yes")
    assert "left alone" in one_line_error(out)
    assert outside.read_bytes() == b"precious"


def test_symlink_in_trash_fails_loudly_and_spares_the_target(
    layout: Layout, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / page_name(1)).write_bytes(b"precious")
    (layout.trash / f"{'e' * 16}.x1").symlink_to(victim)
    out = cli("--root", str(layout.root), "purge", "--unbound", "--yes")
    assert "symlink" in one_line_error(out)
    assert (victim / page_name(1)).read_bytes() == b"precious"


def test_kill_9_during_deletion_then_rerun_finishes(
    layout: Layout, store: Store, tmp_path: Path
) -> None:
    big = make_ns(layout, store, "big", pages=0)
    for i in range(5_000):
        with open(layout.ns_dir(big) / page_name(i, "big"), "wb") as f:
            f.write(b"p")
    keep = make_ns(layout, store, "keep", pages=5, instance="other")
    beside = tmp_path / "beside"
    beside.mkdir()
    (beside / page_name(1)).write_bytes(b"precious")
    before_keep = snapshot(layout.ns_dir(keep))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cachemgr",
            "--log-format",
            "json",
            "--root",
            str(layout.root),
            "purge",
            "--namespace",
            big,
            "--yes",
            "--rate",
            "2000",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    try:
        killed_at = _wait_for_partial_deletion(layout.trash, 5_000)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    assert 0 < killed_at < 5_000, "the kill must land mid-deletion"
    (entry,) = os.listdir(layout.trash)
    assert 0 < len(os.listdir(layout.trash / entry)) < 5_000
    out = cli("--root", str(layout.root), "purge", "--unbound", "--yes")
    assert out.returncode == 0, out.stderr
    assert os.listdir(layout.trash) == []
    assert snapshot(layout.ns_dir(keep)) == before_keep
    assert (beside / page_name(1)).read_bytes() == b"precious"
    assert not layout.ns_dir(big).exists()


def _wait_for_partial_deletion(trash: Path, total: int) -> int:
    """Poll until the trash entry exists and has lost some files; return how many remain."""
    left = wait_for(
        lambda: _left_in_trash(trash),
        lambda n: n is not None and n < total,
        timeout=60,
        what="the deletion to start",
        every=0.002,
    )
    assert left is not None
    return left


def _left_in_trash(trash: Path) -> int | None:
    """Files left in the one trash entry (0 once it is gone); None before the purge made it."""
    entries = os.listdir(trash)
    if not entries:
        return None
    try:
        return len(os.listdir(trash / entries[0]))
    except FileNotFoundError:
        return 0


def test_purge_counts_bytes_in_table_units(layout: Layout, store: Store) -> None:
    ns = make_ns(layout, store, "a", pages=3)
    out = cli("--root", str(layout.root), "purge", "--namespace", ns, "--yes")
    assert out.returncode == 0, out.stderr
    assert f"purged ns {ns} (3 pages, {3 * PAGE_BYTES} B): manifest removed" in out.stdout


@pytest.fixture
def live_server(layout: Layout) -> Iterator[Callable[[str], None]]:
    """Start stand-in servers (real processes) whose storage dir env names a namespace dir."""
    procs: list[subprocess.Popen[str]] = []

    def start(ns: str) -> None:
        env = {**os.environ, "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(layout.ns_dir(ns))}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", "import sys; sys.stdin.read()"],
                stdin=subprocess.PIPE,
                text=True,
                env=env,
            )
        )

    yield start
    for proc in procs:
        proc.communicate(timeout=30)  # closing stdin ends it


def test_a_namespace_a_running_server_uses_keeps_its_dir(
    layout: Layout, store: Store, live_server: Callable[[str], None]
) -> None:
    # A server still runs on ns a, whose instance moved on (init --on-change retain): unbound.
    a = make_ns(layout, store, "a", pages=3)
    b = make_ns(layout, store, "b", pages=2)
    live_server(a)
    before = snapshot(layout.ns_dir(a))
    out = cli("--root", str(layout.root), "purge", "--unbound", "--yes")
    assert out.returncode == 1
    assert f"left alone: ns/{a}: in use by running process" in out.stderr
    assert snapshot(layout.ns_dir(a)) == before and layout.manifest(a).exists()
    assert not layout.ns_dir(b).exists()
    # Named, it is purged, and its dir comes back empty as a bound one's does.
    dry = cli("--root", str(layout.root), "purge", "--namespace", a, "--dry-run")
    assert "in use by running process" in dry.stdout and "recreated empty" in dry.stdout
    out = cli("--root", str(layout.root), "purge", "--namespace", a, "--yes")
    assert out.returncode == 0, out.stderr
    assert f"purged ns {a} (3 pages, 300 B): recreated empty" in out.stdout
    assert os.listdir(layout.ns_dir(a)) == [] and layout.manifest(a).exists()


def test_the_dry_run_names_the_trash_the_real_run_leaves(
    tmp_path: Path, layout: Layout, store: Store
) -> None:
    ns = make_ns(layout, store, "a", pages=2)
    (layout.ns_dir(ns) / "notes.txt").write_text("a person's\n")
    assert cli("--root", str(layout.root), "purge", "--namespace", ns, "--yes").returncode == 1
    (held,) = os.listdir(layout.trash)  # its pages deleted, the notes left for a person
    (tmp_path / "elsewhere").mkdir()
    link = f"{ns}.planted"
    (layout.trash / link).symlink_to(tmp_path / "elsewhere")
    root = str(layout.root)
    dry = cli("--root", root, "purge", "--unbound", "--dry-run")
    assert "would finish deleting" not in dry.stdout
    assert f"would leave alone .trash/{held}: left for a person: 1 foreign file" in dry.stdout
    assert f"would leave alone .trash/{link}: " in dry.stdout
    planned = json.loads(cli("--root", root, "purge", "--unbound", "--dry-run", "--json").stdout)
    real = json.loads(cli("--root", root, "purge", "--unbound", "--yes", "--json").stdout)
    assert len(planned["problems"]) == len(real["problems"]) == 2


@pytest.mark.parametrize("rate", ["nan", "inf", "-nan", "0", "1e10"])
def test_a_rate_that_is_no_rate_is_refused(layout: Layout, store: Store, rate: str) -> None:
    ns = make_ns(layout, store, "a", pages=2)
    before = snapshot(layout.root / "ns")
    out = cli("--root", str(layout.root), "purge", "--namespace", ns, "--yes", "--rate", rate)
    assert out.returncode == 2 and "--rate" in out.stderr
    assert snapshot(layout.root / "ns") == before


def _vllm_stand_in(root_dir: str, cwd: str | Path, **env: str) -> subprocess.Popen[str]:
    """A real process whose argv is a vLLM launch with its fs tier at `root_dir` (as written),
    running in `cwd` until its stdin closes."""
    tier = {"type": "fs", "root_dir": root_dir}
    extra = {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [tier]}
    config = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra}
    launch = ["vllm", "serve", "M", "--kv-transfer-config", json.dumps(config)]
    return subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()", *launch],
        stdin=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env={**os.environ, **env},
    )


@pytest.mark.parametrize(
    ("cwd", "root_dir"),
    [
        ("/", "{ns}/"),  # a trailing slash
        ("/", "{ns}//"),
        ("/", "{root}/ns/../ns/{id}"),
        ("{root}", "ns/{id}"),  # relative: from the server's working dir, as vLLM opens it
        ("{root}", "./ns/{id}/"),
        ("{ns}", "."),
    ],
)
def test_a_running_vllm_whose_root_dir_is_spelt_otherwise_keeps_its_dir(
    layout: Layout, store: Store, cwd: str, root_dir: str
) -> None:
    """vLLM's fs tier joins its root_dir with its folders as given (no `~`, no resolving), so a
    dir written relative to the server's cwd, or with a trailing or doubled slash, is the
    namespace dir all the same: purge must see the server, as for SGLang's env var."""
    a = make_ns(layout, store, "a", pages=3)
    names = {"ns": str(layout.ns_dir(a)), "root": str(layout.root), "id": a}
    server = _vllm_stand_in(root_dir.format(**names), cwd.format(**names))
    try:
        before = snapshot(layout.ns_dir(a))
        out = cli("--root", str(layout.root), "purge", "--unbound", "--yes")
        assert f"left alone: ns/{a}: in use by running process {server.pid}" in out.stderr
        assert snapshot(layout.ns_dir(a)) == before
    finally:
        server.communicate("", timeout=30)


@pytest.mark.parametrize("root_dir", ["ns/{id}", "~/ns/{id}"])
def test_a_vllm_whose_root_dir_only_looks_like_the_namespace_is_no_user(
    layout: Layout, store: Store, tmp_path: Path, root_dir: str
) -> None:
    """vLLM does not expand `~` in a JSON value, and reads a relative dir from its own cwd: a
    server elsewhere whose root_dir merely reads as the namespace's does not keep it."""
    a = make_ns(layout, store, "a", pages=3)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    server = _vllm_stand_in(root_dir.format(id=a), elsewhere, HOME=str(layout.root))
    try:
        out = cli("--root", str(layout.root), "purge", "--unbound", "--yes")
        assert out.returncode == 0, out.stderr
        assert not layout.ns_dir(a).exists()
    finally:
        server.communicate("", timeout=30)


# A purge run as the CLI runs it, in a process of its own, that is killed (SIGKILL, by itself:
# no handler, no finally runs) at a rename into .trash/, just before or just after it, as
# test_purge.py's purges stopped right after each rename: os.rename (an unbound namespace's
# move) or purge.exchange (a bound one's swap with its empty successor).
_KILLED_PURGE = """
import os, runpy, signal, sys
import cachemgr.ns.purge as purge
when, ns, root = sys.argv[1:4]

def killed(real, into_trash):
    def move(*args, **kw):
        if not into_trash(args):
            return real(*args, **kw)
        if when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        real(*args, **kw)
        os.kill(os.getpid(), signal.SIGKILL)
    return move

os.rename = killed(os.rename, lambda args: str(args[1]).startswith(ns + "."))
purge.exchange = killed(purge.exchange, lambda args: True)
sys.argv = ["cachemgr", "--root", root, "purge", "--namespace", ns, "--yes"]
runpy.run_module("cachemgr", run_name="__main__")
"""


@pytest.mark.parametrize("bound", [False, True], ids=["unbound", "bound"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_purge_killed_at_its_rename_is_audited_once_if_it_moved(
    layout: Layout, store: Store, settings: Settings, bound: bool, when: str
) -> None:
    """kill -9 right after the rename, before the transaction that records it commits: the
    trash entry is drained later all the same, and the purge's audit row must not be lost
    with it. The daemon's GC, at its start, writes it once; a later purge (of another
    namespace) does not again. Killed right before the rename, nothing moved: no purge is
    audited, then or later."""
    ns = make_ns(layout, store, "a", pages=3, instance="srv" if bound else None)
    other = make_ns(layout, store, "b", pages=1)
    script = [sys.executable, "-c", _KILLED_PURGE, when, ns, str(layout.root)]
    proc = subprocess.run(script, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    moved = when == "after"
    assert bool(os.listdir(layout.trash)) == (moved or bound)  # (bound: its empty successor)
    assert audit_rows(store, "purge", ns) == []  # its transaction never committed
    with running_daemon(settings):
        wait_for(lambda: os.listdir(layout.trash), lambda left: left == [], timeout=30)
    audited = [("manual", "cli", 3, 3 * PAGE_BYTES)] if moved else []
    assert audit_rows(store, "purge", ns) == audited
    assert cli("--root", str(layout.root), "purge", "--namespace", other, "--yes").returncode == 0
    assert audit_rows(store, "purge", ns) == audited
    assert audit_rows(store, "purge", other) == [("manual", "cli", 1, PAGE_BYTES)]
    if not moved:  # the namespace is as it was
        assert len(os.listdir(layout.ns_dir(ns))) == 3


def test_a_purge_whose_drain_meets_a_foreign_lock_stops_says_who_and_exits_1(
    layout: Layout,
    store: Store,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A person's `sqlite3` shell takes the state DB's write lock while `purge --yes` drains
    the namespace it moved away: the drain stops rather than delete the rest unrecorded, a
    warning names the holder, the deleted files are recorded once the lock is free, and the
    purge exits 1 saying the rest stays in .trash/. In this process: the lock must come
    between two of the drain's parts (the unlink call wrapped to take it, the warning to
    release it)."""
    ns = make_ns(layout, store, "a", pages=2_500)
    monkeypatch.setattr(trash, "COUNT_EVERY", 0.0)  # a count tick every 1,024 files
    monkeypatch.setattr(trash, "COUNT_PATIENCE", 0.05)
    monkeypatch.setattr(store_module, "LOCK_POLL", 0.05)
    monkeypatch.setattr(store_module, "BUSY_TIMEOUT", 0.3)  # a write's patience
    foreign = ForeignLock(layout.db_path)
    unlink, parts = deletion.check_and_unlink, [0]

    def then_lock(*args: Any) -> Any:
        parts[0] += 1
        if parts[0] == 4:  # 1,024 files: the next count tick finds the lock
            foreign.take()
        return unlink(*args)

    said, say = [], common._say_locked

    def release(holder: str) -> None:
        said.append(holder)
        say(holder)
        foreign.release()

    monkeypatch.setattr(deletion, "check_and_unlink", then_lock)
    monkeypatch.setattr(common, "_say_locked", release)
    with foreign:
        code = cli_here(["--root", str(layout.root), "purge", "--namespace", ns, "--yes"])
    _, err = capsys.readouterr()
    assert code == 1 and len(said) == 1
    assert "cachemgr: error: the drain of .trash/ stopped: the state DB was write-locked" in err
    (entry,) = os.listdir(layout.trash)
    assert len(os.listdir(layout.trash / entry)) == 2_500 - 1_024  # stopped at the tick
    assert audit_rows(store, "delete-trash", ns) == [("trash", "cli", 1_024, 1_024 * PAGE_BYTES)]


def test_a_purge_off_a_terminal_logs_its_progress_at_the_default_level(
    layout: Layout, store: Store
) -> None:
    """Off a terminal a purge's drain says how far it got each second, as the docs promise:
    the one-shot commands' default level (warning) hid those lines. Asked for a level above
    info, they stay quiet."""
    make_ns(layout, store, "a", pages=2600)
    out = cli("--root", str(layout.root), "purge", "--unbound", "--yes", "--rate", "1000")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    ticks = [line for line in lines if line["msg"] == "deleting trash"]
    assert any(0 < t["files"] < 2600 and t["total_files"] == 2600 for t in ticks), lines
    make_ns(layout, store, "b", pages=400)
    quiet = cli(
        "--root",
        str(layout.root),
        "--log-level",
        "error",
        "purge",
        "--unbound",
        "--yes",
        "--rate",
        "250",
    )
    assert quiet.returncode == 0 and "deleting trash" not in quiet.stderr, quiet.stderr
