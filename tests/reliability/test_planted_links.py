"""Writes that leave the root: a symlink planted at any path cachemgr writes, and a trash entry
or namespace dir moved out of the root while its files are being deleted.

The paths come from `Layout.written`, the one list of what cachemgr writes: a writer added
without being listed there fails the first test below, and every listed path gets a link.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cachemgr.backends import FileKind
from cachemgr.errors import CachemgrError
from cachemgr.fs.deletion import Listeners, Pacer, delete_files
from cachemgr.fs.leadership import kernel_id
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout, db_files
from cachemgr.ns.trash import drain_trash
from cachemgr.settings import load_settings
from cachemgr.sglang.hicache import HICACHE_FILE
from cachemgr.state.store import Store
from tests.daemon_helpers import running_daemon, wait_for
from tests.nsfixtures import cli, one_line_error, page_name
from tests.test_identity import make_model

BOOT = kernel_id()
PLACEHOLDER = "0" * 16  # stands for the namespace init creates, unknown until it runs
_SKELETON = Layout.at(Path("/R"))
WRITTEN = [str(p.relative_to("/R")) for p in _SKELETON.written(BOOT, (PLACEHOLDER,), ("default",))]
DIRS = {str(p.relative_to("/R")) for p in _SKELETON.written_dirs((PLACEHOLDER,))}
CMD = "sglang serve --enable-hierarchical-cache --hicache-storage-backend file --page-size 64"
NO_STORAGE_ENV = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": ""}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "m")


def init(root: Path, model: Path) -> subprocess.CompletedProcess[str]:
    launch = [*CMD.split(), "--model-path", str(model), "--kv-cache-dtype", "bfloat16"]
    return cli("--root", str(root), "init", "--json", "--", *launch, env=NO_STORAGE_ENV)


def initialized_root(root: Path, model: Path) -> str:
    """A root as `init` leaves it, with pages in its namespace and a purged one in .trash/."""
    out = init(root, model)
    assert out.returncode == 0, out.stderr
    ns_dir = Path(json.loads(out.stdout)["storage_dir"])
    for i in range(3):
        (ns_dir / page_name(i)).write_bytes(b"p" * 64)
    entry = root / ".trash" / f"{'a' * 16}.x1"
    entry.mkdir()
    (entry / page_name(9)).write_bytes(b"t" * 64)
    return ns_dir.name


def on_disk(layout: Layout) -> set[Path]:
    """What cachemgr itself put under the root and the state dir (not SGLang's pages, not
    .trash/ entries, whose names are a purge's own)."""
    found = set()
    for top in (layout.root, layout.state_dir):
        for dirpath, dirnames, filenames in os.walk(top):
            here = Path(dirpath)
            if here == layout.trash:
                dirnames[:] = []
            for name in dirnames + filenames:
                if here.parent == layout.ns_root and here != layout.ns_root:
                    assert HICACHE_FILE.classify(name) is not FileKind.FOREIGN, here / name
                    continue
                found.add(here / name)
    return found


def test_layout_lists_every_path_a_real_run_writes(tmp_path: Path, model: Path) -> None:
    root = tmp_path / "root"
    ns = initialized_root(root, model)
    layout = Layout.at(root)
    settings = load_settings(root=root, log_format="json")
    written = set(layout.written(BOOT, (ns,), ("default",)))
    assert cli("--root", str(root), "gc", "--yes").returncode == 0
    with running_daemon(settings):
        seen_live = on_disk(layout)
    out = cli("--root", str(root), "purge", "--all", "--yes")
    assert out.returncode == 0, out.stderr
    unlisted = (seen_live | on_disk(layout)) - written
    assert not unlisted, f"written but not in Layout.written: {sorted(map(str, unlisted))}"
    assert layout.index_ready(BOOT) in seen_live  # the daemon's marker, gone once it stopped


def plant(path: Path, target: Path) -> None:
    """Replace whatever is at `path` by a symlink to `target`."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    path.symlink_to(target)


def worked_or_refused(command: str, out: subprocess.CompletedProcess[str]) -> None:
    """Exit 0 (worked around the link), or one `cachemgr: error:` line; never a traceback.
    doctor exits 1/2 for findings it printed, which is its way of working."""
    assert "Traceback" not in out.stderr, f"{command}: {out.stderr}"
    if out.returncode != 0 and not (command == "doctor" and "cachemgr: error:" not in out.stderr):
        one_line_error(out)


class _Tracebacks(logging.Handler):
    """Keeps the records logged with a traceback (log.exception)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(record)


@contextmanager
def logged_tracebacks() -> Iterator[list[logging.LogRecord]]:
    """The records cachemgr logs with a traceback while inside."""
    handler = _Tracebacks()
    logger = logging.getLogger("cachemgr")
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)


def serve_briefly(root: Path) -> None:
    """The real daemon on a loopback port: ready then stopped, or refused with one line."""
    settings = load_settings(root=root, log_format="json", gc_interval="1s")
    with logged_tracebacks() as tracebacks:
        try:
            with running_daemon(settings) as running:
                assert running.daemon.indexer.error is None
        except CachemgrError as e:
            assert "\n" not in str(e)
    assert not tracebacks, [r.getMessage() for r in tracebacks]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-victim-entry", "dangling"])
@pytest.mark.parametrize("rel", WRITTEN, ids=[r.replace(BOOT, "<boot>") for r in WRITTEN])
def test_a_link_planted_at_a_written_path_is_never_followed(
    tmp_path: Path, model: Path, victim: Path, rel: str, dangling: bool
) -> None:
    root = tmp_path / "root"
    ns = initialized_root(root, model)
    path = root / rel.replace(PLACEHOLDER, ns)
    if dangling:
        target = victim / f"planted-{path.name}"
    else:
        target = victim / ("empty-dir" if rel in DIRS else _existing_victim_file(path.name))
    plant(path, target)
    worked_or_refused("init", init(root, model))
    for argv in (("ls",), ("status",), ("doctor",), ("gc", "--yes")):
        worked_or_refused(argv[0], cli("--root", str(root), *argv))
    serve_briefly(root)
    worked_or_refused("purge", cli("--root", str(root), "purge", "--all", "--yes"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "rel", [r for r in WRITTEN if r not in DIRS], ids=lambda r: r.replace(BOOT, "<boot>")
)
def test_a_hard_link_planted_at_a_written_file_is_never_written_through(
    tmp_path: Path, model: Path, victim: Path, rel: str
) -> None:
    """A hard link shares its inode with a file outside: writing it in place (a lock note,
    the reserve's fallocate, SQLite) would change that file. Replacing it (an atomic rename)
    is fine; writing through it never is."""
    root = tmp_path / "root"
    ns = initialized_root(root, model)
    path = root / rel.replace(PLACEHOLDER, ns)
    if path.is_symlink() or path.exists():
        path.unlink()
    os.link(victim / _existing_victim_file(path.name), path)
    worked_or_refused("init", init(root, model))
    for argv in (("ls",), ("status",), ("doctor",), ("gc", "--yes")):
        worked_or_refused(argv[0], cli("--root", str(root), *argv))
    serve_briefly(root)
    worked_or_refused("purge", cli("--root", str(root), "purge", "--all", "--yes"))


def _existing_victim_file(name: str) -> str:
    return "state.db" if name.startswith("state.db") else "gc.lock"


def test_cachedir_tag_link_is_left_alone(tmp_path: Path, victim: Path) -> None:
    layout = Layout.at(tmp_path / "root")
    layout.root.mkdir()
    layout.tag.symlink_to(victim / "no-such-tag")
    create_root(layout)
    assert os.readlink(layout.tag) == str(victim / "no-such-tag")
    assert not (victim / "no-such-tag").exists()


def test_state_db_link_is_refused_before_sqlite_opens_it(tmp_path: Path, victim: Path) -> None:
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    for link in db_files(layout.db_path):
        link.symlink_to(victim / "state.db")
        with pytest.raises(CachemgrError, match="a symlink, a hard link or not a regular file"):
            Store.open(layout.db_path)
        link.unlink()
    Store.open(layout.db_path).close()


# --- a directory moved out of the root while its files are deleted ---------------------------

N_PAGES = 3000
STOPPED = "moved or replaced while its files were deleted; stopped"


def fill(directory: Path, n: int) -> None:
    directory.mkdir(parents=True)
    for i in range(n):
        (directory / page_name(i)).write_bytes(b"x")


def move_when(
    directory: Path, away: Path, left_at_most: int
) -> tuple[threading.Thread, list[set[str]]]:
    """A thread that renames `directory` to `away` once at most `left_at_most` files remain in
    it, then lists what it holds at once: the files present at the move."""
    at_move: list[set[str]] = []

    def run() -> None:
        wait_for(
            lambda: len(os.listdir(directory)), lambda n: n <= left_at_most, timeout=60, every=0.005
        )
        os.rename(directory, away)
        at_move.append(set(os.listdir(away)))

    thread = threading.Thread(target=run, name="test-mover")
    thread.start()
    return thread, at_move


def assert_nothing_deleted_after_move(away: Path, at_move: list[set[str]]) -> None:
    (present,) = at_move
    after = set(os.listdir(away))
    assert after <= present
    # The one unlink in flight while the rename happened may land after the listing.
    assert len(present - after) <= 1, f"{len(present - after)} files deleted after the move"
    assert len(after) > N_PAGES // 3  # the move really came mid-deletion


def test_drain_stops_when_its_trash_entry_leaves_the_root(tmp_path: Path) -> None:
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    entry = layout.trash / f"{'b' * 16}.moved"
    fill(entry, N_PAGES)
    outside = tmp_path / "outside"
    outside.mkdir()
    away = outside / "moved-here"
    mover, at_move = move_when(entry, away, left_at_most=2 * N_PAGES // 3)
    store = Store.open(layout.db_path)
    try:
        report = drain_trash(layout, store, pacer=Pacer(rate=2000, batch=1))
    finally:
        store.close()
        mover.join(60)
    assert_nothing_deleted_after_move(away, at_move)
    assert report.refused == (f".trash/{entry.name}: {STOPPED}",)
    assert report.files == N_PAGES - len(os.listdir(away))  # what it deleted, all in the root


def test_gc_deletion_stops_when_its_namespace_dir_leaves_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    create_root(Layout.at(root))
    ns_dir = root / "ns" / ("c" * 16)
    fill(ns_dir, N_PAGES)
    away = tmp_path / "outside"
    mover, at_move = move_when(ns_dir, away, left_at_most=2 * N_PAGES // 3)
    names = sorted(os.listdir(ns_dir))
    try:
        report = delete_files(
            root, f"ns/{'c' * 16}", names, listeners=Listeners(Pacer(rate=2000, batch=1))
        )
    finally:
        mover.join(60)
    assert_nothing_deleted_after_move(away, at_move)
    assert report.refused == (f"ns/{'c' * 16}: {STOPPED}",)
