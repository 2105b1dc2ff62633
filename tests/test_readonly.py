"""Read-only commands write nothing: not on a mistyped root, not on a real one.

Only `init`, `exec` and `serve` create a root (and `config --check`, which is asked to);
the others say "no cache root at …" in one line. On a root that exists, the reading
commands work on a copy of the state DB, so every file and directory keeps its name, size
and mtime — the DB's -wal/-shm, the space reserve and the lock files included.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.nsfixtures import cli, one_line_error, page_name
from tests.test_identity import make_model

NO_STORAGE_ENV = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": ""}
READ_ONLY = {
    "ls": ["ls", "--json"],
    "status": ["status", "--json", "--port", "1"],  # no daemon answers there: from disk
    "doctor": ["doctor"],
    "gc --dry-run": ["gc", "--dry-run", "--json"],
    "purge --dry-run": ["purge", "--all", "--dry-run", "--json"],
}
# GC settings under which the root has work due: the temp file, the unbound namespace.
WORK_DUE = {
    "CACHEMGR_GC_MIN_AGE": "0",
    "CACHEMGR_GC_TMP_TTL": "1s",
    "CACHEMGR_GC_KEEP_UNBOUND": "0",
}


def tree(top: Path) -> dict[str, tuple[bool, int, int]]:
    """Every path under `top` (itself included): is it a dir, its size and its mtime."""
    found = {}
    for path in [top, *sorted(top.rglob("*"))]:
        st = os.lstat(path)
        is_dir = path.is_dir() and not path.is_symlink()
        found[str(path.relative_to(top))] = (is_dir, 0 if is_dir else st.st_size, st.st_mtime_ns)
    return found


@pytest.mark.parametrize("command", sorted(READ_ONLY))
def test_on_a_missing_root_it_says_so_and_creates_nothing(tmp_path: Path, command: str) -> None:
    root = tmp_path / "typo"
    before = sorted(tmp_path.iterdir())
    out = cli("--root", str(root), *READ_ONLY[command])
    assert one_line_error(out) == (
        f"cachemgr: error: no cache root at {root} (init or serve creates it)"
    )
    assert out.returncode == 1  # NotFoundError's exit code, as for every missing thing
    assert sorted(tmp_path.iterdir()) == before
    assert not root.exists()


def test_fingerprint_needs_no_root_and_makes_none(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model")
    before = sorted(tmp_path.iterdir())
    out = cli("--root", str(tmp_path / "typo"), "fingerprint", "--model-path", str(model))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ns_id ")
    assert sorted(tmp_path.iterdir()) == before


@pytest.fixture
def used_root(tmp_path: Path) -> Path:
    """A root made by init, with pages, a stale temp file and an unbound old namespace: work
    for every reading command to report (and for the dry runs to plan) but not to do."""
    root, model = tmp_path / "root", make_model(tmp_path / "model")
    for page_size in ("32", "64"):  # the second init leaves the first namespace unbound
        out = cli(
            "--root",
            str(root),
            "init",
            "--json",
            "--on-change",
            "retain",
            "--model-path",
            str(model),
            "--page-size",
            page_size,
            env=NO_STORAGE_ENV,
        )
        assert out.returncode == 0, out.stderr
    ns_dir = Path(json.loads(out.stdout)["storage_dir"])
    for i in range(5):
        (ns_dir / page_name(i)).write_bytes(b"x" * 4096)
    stale = ns_dir / f".{'0' * 32}.tmp"  # SGLang 0.5.23 temp-file name
    stale.write_bytes(b"t")
    os.utime(stale, (1, 1))
    return root


@pytest.mark.parametrize("command", sorted(READ_ONLY))
def test_on_an_existing_root_it_changes_nothing(used_root: Path, command: str) -> None:
    before = tree(used_root)
    out = cli("--root", str(used_root), *READ_ONLY[command], env=WORK_DUE)
    assert out.returncode in (0, 1), out.stderr  # doctor: 1 for warnings
    assert "Traceback" not in out.stderr
    assert tree(used_root) == before


def test_the_dry_runs_still_see_the_work(used_root: Path) -> None:
    """The copy is a real one: what a dry run reports is what the real run then does."""
    dry = json.loads(
        cli("--root", str(used_root), "gc", "--dry-run", "--json", env=WORK_DUE).stdout
    )
    assert dry["files"] >= 1
    real = json.loads(cli("--root", str(used_root), "gc", "--yes", "--json", env=WORK_DUE).stdout)
    assert real["files"] == dry["files"]


@pytest.mark.parametrize("command", sorted(READ_ONLY))
@pytest.mark.parametrize("damage", ["missing", "stale"])
def test_binding_files_out_of_line_are_not_rewritten_by_a_reader(
    used_root: Path, command: str, damage: str
) -> None:
    """Bringing binding files in line with the DB is a write: `init`, `gc` and the daemon do
    it, a reading command never does (nor does it touch root.lock)."""
    bind = used_root / "ns" / "default.bind"
    if damage == "missing":
        bind.unlink()
    else:
        bind.write_text(bind.read_text().replace('"ns_id": "', '"ns_id": "0', 1)[:-1] + "\n")
    before = tree(used_root)
    out = cli("--root", str(used_root), *READ_ONLY[command], env=WORK_DUE)
    assert "Traceback" not in out.stderr
    assert tree(used_root) == before


def test_fingerprint_writes_nothing_in_an_existing_dir_or_a_used_root(
    tmp_path: Path, used_root: Path
) -> None:
    """An existing directory is not made a root (a typo like --root ~ must not tag a home
    dir), and a root's digest cache is read from a copy: nothing changes."""
    model = make_model(tmp_path / "model-fp")
    empty = tmp_path / "just-a-dir"
    empty.mkdir()
    for root in (empty, used_root):
        before = tree(root)
        out = cli("--root", str(root), "fingerprint", "--model-path", str(model))
        assert out.returncode == 0, out.stderr
        assert tree(root) == before


@pytest.mark.parametrize("command", sorted(READ_ONLY))
def test_a_file_where_a_dir_should_be_is_one_line(
    used_root: Path, tmp_path: Path, command: str
) -> None:
    """--state-dir naming a file: one line naming it, exit 2, never a traceback."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = cli("--root", str(used_root), "--state-dir", str(afile), *READ_ONLY[command])
    assert "Traceback" not in out.stderr, out.stderr
    if out.returncode not in (0, 1):  # doctor may report it as a finding instead
        assert out.returncode == 2
        one_line_error(out)
