"""The state DB is an index of the disk: lost or corrupt, it is rebuilt from the manifests and
the binding files (tests/reliability/test_bindings_survive.py has the bindings' own tests)."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
from pathlib import Path

import pytest

from cachemgr.daemon.indexer import Indexer, IndexerConfig
from cachemgr.errors import StateError
from cachemgr.layout import Layout
from cachemgr.state.store import Store, connect
from tests.nsfixtures import cli, page_name
from tests.test_gc_race import init, state_of
from tests.test_identity import make_model


@pytest.fixture
def old_ns(root: Path, tmp_path: Path) -> str:
    """A namespace with pages and a manifest, bound by an init whose DB is then lost."""
    ns = str(init(root, make_model(tmp_path / "model"), 64)["ns_id"])
    for i in range(5):
        (root / "ns" / ns / page_name(i)).write_bytes(b"k" * 10)
    return ns


def lose_db(root: Path, *, binding_too: bool = False) -> None:
    """Delete the DB; `binding_too`: and the binding file, as on a root bound by a cachemgr
    older than binding files, so that nothing on disk says the namespace is in use."""
    for f in (root / ".cachemgr").glob("state.db*"):
        f.unlink()
    if binding_too:
        (root / "ns" / "default.bind").unlink()


def test_gc_reclaims_a_namespace_the_lost_db_forgot(root: Path, old_ns: str) -> None:
    lose_db(root, binding_too=True)
    out = cli(
        "--root", str(root), "gc", "--yes", "--min-age", "0", env={"CACHEMGR_GC_KEEP_UNBOUND": "0"}
    )
    assert out.returncode == 0, out.stderr
    assert not (root / "ns" / old_ns).exists()
    assert not (root / "ns" / f"{old_ns}.json").exists()
    assert state_of(root, old_ns) == ("purged", ())


def test_ls_lists_a_forgotten_namespace_as_unbound_with_its_times(root: Path, old_ns: str) -> None:
    manifest = json.loads((root / "ns" / f"{old_ns}.json").read_text())
    lose_db(root, binding_too=True)
    out = cli("--root", str(root), "ls", "--json")
    assert out.returncode == 0, out.stderr
    (ns,) = json.loads(out.stdout)["namespaces"]
    assert (ns["ns_id"], ns["state"], ns["pages"]) == (old_ns, "unbound", 5)
    assert (ns["created_at"], ns["last_active_at"]) == (
        manifest["created_at"],
        manifest["last_active_at"],
    )
    assert not Layout.at(root).db_path.exists()  # ls reads; the next writer rebuilds the DB


def test_the_daemons_first_scan_registers_forgotten_namespaces(root: Path, old_ns: str) -> None:
    lose_db(root)
    layout = Layout.at(root)
    store = Store.open(layout.db_path)
    ix = Indexer(layout, store, IndexerConfig(batch_interval=0.05))
    ix.start()
    try:
        assert ix.state.ready.wait(10)
    finally:
        ix.stop()
    try:
        assert store.conn.execute("SELECT state FROM namespaces").fetchall()[0][0] == "active"
    finally:
        store.close()


def test_a_garbage_db_is_moved_aside_and_rebuilt(root: Path, old_ns: str) -> None:
    state = root / ".cachemgr"
    lose_db(root)
    (state / "state.db").write_bytes(b"this is not sqlite " * 500)
    (state / "state.db-wal").write_bytes(b"junk")
    out = cli("--root", str(root), "ls", "--json")
    assert out.returncode == 0, out.stderr
    warnings = [json.loads(line) for line in out.stderr.splitlines()]
    assert [w["msg"] for w in warnings if w["level"] == "warning"] == [
        "state DB was corrupt; moved it aside and started a fresh one, rebuilt from disk"
    ]
    (aside,) = state.glob("state.db.corrupt-*[0-9]")
    assert aside.read_bytes().startswith(b"this is not sqlite")
    assert (state / f"{aside.name}-wal").read_bytes() == b"junk"
    assert json.loads(out.stdout)["namespaces"][0]["state"] == "bound"  # from its binding file
    again = init(root, root.parent / "model", 64)  # the model of `old_ns`: still its own
    assert (again["ns_id"], again["outcome"]) == (old_ns, "unchanged")


def test_a_newer_db_is_refused_not_moved_aside(tmp_path: Path) -> None:
    conn = connect(tmp_path / "state.db")
    conn.execute("PRAGMA user_version = 999")
    conn.close()
    with pytest.raises(StateError, match="newer than this cachemgr"):
        Store.open(tmp_path / "state.db")
    assert sorted(p.name for p in tmp_path.iterdir() if "corrupt" in p.name) == []


def test_a_newer_db_says_in_one_line_how_to_roll_back_and_that_works(tmp_path: Path) -> None:
    """A rolled-back image met the DB a newer one migrated: init and serve exit 2 and the
    engine does not start. The line gives the command that moves the DB (and its -wal) aside;
    run as given, the next open starts a fresh DB, rebuilt from disk."""
    state = tmp_path / "state dir"  # (a space: the command quotes it)
    Store.open(state / "state.db").close()
    conn = connect(state / "state.db")
    conn.execute("PRAGMA user_version = 999")
    conn.close()
    with pytest.raises(StateError) as refused:
        Store.open(state / "state.db")
    line = str(refused.value)
    assert "\n" not in line
    assert "schema version 999, newer than this cachemgr" in line, line
    command = line.split(
        "then move the DB aside (the index is rebuilt from disk; its audit "
        "history stays in the copy): "
    )[1]
    subprocess.run(["sh", "-c", command], check=True)
    assert not [p.name for p in state.iterdir() if p.name.startswith("state.db-")]
    copy = sqlite3.connect(f"file:{state / 'state.db.schema-999'}?mode=ro", uri=True)
    assert copy.execute("PRAGMA user_version").fetchone()[0] == 999
    copy.close()
    Store.open(state / "state.db").close()  # a fresh DB, at this cachemgr's schema


def test_only_the_newest_corrupt_copies_are_kept(root: Path, old_ns: str, tmp_path: Path) -> None:
    """A DB corrupted again and again left one copy each (as big as the DB) until the state
    dir was full: the oldest go, said in the log; nothing but those copies is removed."""
    state = root / ".cachemgr"
    old = [f"state.db.corrupt-{1_700_000_000 + i}" for i in range(3)] + [
        "state.db.corrupt-1700000002-2"  # a second one within that second
    ]
    for name in old:
        (state / name).write_bytes(b"an old corrupt copy")
        (state / f"{name}-wal").write_bytes(b"its wal")
    outside = tmp_path / "outside"
    outside.write_bytes(b"not cachemgr's")
    (state / "state.db.corrupt-1600000000").symlink_to(outside)  # oldest by name: a link
    foreign = ["state.db.corrupt-notes.txt", "state.db.corrupt-1600000000-x", "other.corrupt-1"]
    for name in foreign:
        (state / name).write_bytes(b"a person's")
    (state / "state.db").write_bytes(b"this is not sqlite " * 500)
    out = cli("--root", str(root), "ls", "--json")
    assert out.returncode == 0, out.stderr
    warnings = [json.loads(line) for line in out.stderr.splitlines()]
    (dropped,) = [w for w in warnings if w["msg"].startswith("removed older corrupt")]
    assert dropped["removed"] == old[:2] and dropped["kept"] == 3
    copy = re.compile(r"state\.db\.corrupt-\d+(-\d+)?")
    copies = {p.name for p in state.iterdir() if copy.fullmatch(p.name) and not p.is_symlink()}
    assert len(copies) == 3 and set(old[2:]) < copies  # and the one just made
    for name in old[:2]:
        assert not (state / name).exists() and not (state / f"{name}-wal").exists()
    assert (state / f"{old[3]}-wal").read_bytes() == b"its wal"
    assert outside.read_bytes() == b"not cachemgr's"
    assert (state / "state.db.corrupt-1600000000").is_symlink()
    assert all((state / name).read_bytes() == b"a person's" for name in foreign)
