"""A purged namespace whose dir held a foreign file stays in .trash/ (deletion touches only
SGLang's pages and temps): every surface says it is left for a person, where, and a fix that
works."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from cachemgr.state.store import Store
from tests.daemon_helpers import running_daemon
from tests.nsfixtures import cli, make_ns


@pytest.fixture
def left(layout: Layout, store: Store) -> Iterator[tuple[Path, Path]]:
    """(the trash entry, the foreign file in it) after a purge deleted its pages."""
    ns = make_ns(layout, store, "a", pages=3)
    (layout.ns_dir(ns) / "notes.txt").write_text("a person's notes\n")
    out = cli("--root", str(layout.root), "purge", "--namespace", ns, "--yes")
    assert out.returncode == 1  # the foreign file was left alone, and said so
    (entry,) = layout.trash.iterdir()
    assert [p.name for p in entry.iterdir()] == ["notes.txt"]  # the pages are gone
    yield entry, entry / "notes.txt"


def note(entry: Path, foreign: Path) -> str:
    return f".trash/{entry.name}: left for a person: 1 foreign file, e.g. {foreign}"


def test_ls_and_status_say_left_for_a_person(layout: Layout, left: tuple[Path, Path]) -> None:
    entry, foreign = left
    root = str(layout.root)
    table = " ".join(cli("--root", root, "ls").stdout.replace("│", " ").split())  # folded at 80
    assert "left for a person: 1 foreign file" in table and "deleting" not in table
    (listed,) = json.loads(cli("--root", root, "ls", "--json").stdout)["trash"]
    assert (listed["foreign"], listed["example"]) == (1, str(foreign))
    status = cli("--root", root, "status", "--port", "1")
    assert f"warning: {note(entry, foreign)}" in status.stdout.splitlines()
    report = json.loads(cli("--root", root, "status", "--json", "--port", "1").stdout)
    assert report["left_for_a_person"] == [note(entry, foreign)]


def test_doctor_names_the_path_and_a_fix_that_works(
    layout: Layout, left: tuple[Path, Path]
) -> None:
    entry, foreign = left
    out = cli("--root", str(layout.root), "doctor", "--json")
    (finding,) = [f for f in json.loads(out.stdout) if f["code"].startswith("trash")]
    assert finding["code"] == "trash-foreign"
    assert finding["message"] == note(entry, foreign)
    assert str(foreign) in finding["fix"] and "purge --unbound" not in finding["fix"]
    # Following it: remove the file, run the command it names; the entry is gone.
    foreign.unlink()
    assert f"`cachemgr --root {layout.root} gc --yes`" in finding["fix"]
    assert cli("--root", str(layout.root), "gc", "--yes").returncode == 0
    assert not entry.exists()
    out = cli("--root", str(layout.root), "doctor", "--json")
    assert [f for f in json.loads(out.stdout) if f["code"].startswith("trash")] == []


def test_the_daemon_warns_in_gc_done_and_the_api(layout: Layout, left: tuple[Path, Path]) -> None:
    entry, foreign = left
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("cachemgr.gc.execute")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with running_daemon(load_settings(root=layout.root)) as dm:
            assert dm.status()["left_for_a_person"] == [note(entry, foreign)]
            gc = dm.post("/v1/gc").json()
            assert note(entry, foreign) in gc["warnings"]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    done = [r for r in records if r.getMessage() == "gc done"]
    assert done and all(note(entry, foreign) in r.__dict__["warnings"] for r in done)


def test_foreign_files_between_vllm_dirs_get_a_real_example(layout: Layout, store: Store) -> None:
    """Names at a level deletion does not list (below a rank dir, above the block dirs) used
    to give `left for a person: 13 foreign files, e.g. None`."""
    from cachemgr.ns.trash import describe_trash, left_for_people
    from tests.vllmtrees import vllm_tree, write_blocks

    ns, ns_dir, folder = vllm_tree(layout, store)
    (block,) = write_blocks(ns_dir, folder, 1)
    middle = (ns_dir / block).parent.parent  # <folder>_r0/<3 hex>/
    for i in range(13):
        (middle / f"notes{i}.txt").write_text("a person's notes\n")
    out = cli("--root", str(layout.root), "purge", "--namespace", ns, "--yes")
    assert out.returncode == 1, out.stderr
    (entry,) = describe_trash(layout)
    assert entry.example is not None and Path(entry.example).is_file(), entry
    assert Path(entry.example).is_relative_to(layout.trash / entry.name)
    (line,) = left_for_people(layout)
    assert "e.g. None" not in line and line.endswith(f"e.g. {entry.example}"), line


def test_runs_that_delete_nothing_write_no_audit_row(
    layout: Layout, store: Store, left: tuple[Path, Path]
) -> None:
    # The daemon's GC tries the entry every run: each wrote a delete-trash row of 0 pages.
    for _ in range(3):
        assert cli("--root", str(layout.root), "gc", "--yes").returncode == 0
    assert cli("--root", str(layout.root), "purge", "--unbound", "--yes").returncode == 1
    rows = store.conn.execute(
        "SELECT actor, pages FROM audit WHERE action = 'delete-trash' ORDER BY id"
    ).fetchall()
    assert [tuple(r) for r in rows] == [("cli", 3)]  # the purge's own drain, and no other
