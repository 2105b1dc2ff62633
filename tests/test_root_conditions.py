"""Every command against a root it cannot write, a read-only mount and a missing root: one
line and a non-zero exit where it must fail, never a traceback.

Runs as root (CI does): the "cannot write" cases drop to uid/gid 65534 with setpriv, the
read-only one bind-mounts the root and remounts it read-only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.nsfixtures import cli, one_line_error, page_name
from tests.test_identity import make_model
from tests.test_init import CMD, NO_STORAGE_ENV

NOBODY = "65534"
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="dropping to another uid and mounting need root and setpriv (CI runs as root)",
)


def commands(model: Path) -> dict[str, tuple[list[str], bool]]:
    """name → (arguments, whether it must write: then it must fail on these roots)."""
    launch = ["--", *CMD.split(), "--model-path", str(model)]
    return {
        "ls": (["ls"], False),
        "ls --json": (["ls", "--json"], False),
        "status": (["status", "--port", "1"], False),
        "doctor": (["doctor"], False),
        "doctor -- launch": (["doctor", *launch], False),
        "gc --dry-run": (["gc", "--dry-run"], False),
        "gc --yes": (["gc", "--yes"], True),
        "purge --dry-run": (["purge", "--all", "--dry-run"], False),
        "purge --yes": (["purge", "--all", "--yes"], True),
        "init": (["init", *launch], True),
        "fingerprint": (["fingerprint", *launch], False),
        "config": (["config"], False),
        "config --check": (["config", "--check"], True),
        "serve": (["serve", "--port", "0"], True),
    }


@pytest.fixture(scope="module")
def shared() -> Iterator[Path]:
    """A world-traversable dir (pytest's tmp_path is 0700, closed to uid 65534) with a model,
    a used root (made by init as root: its dirs are 0755, so readable, not writable), an
    empty dir and one only root may read."""
    top = Path(tempfile.mkdtemp(prefix="cachemgr-conditions-"))
    top.chmod(0o755)
    model = make_model(top / "model")
    for path in [model, *model.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    root = top / "used"
    out = cli(
        "--root",
        str(root),
        "init",
        "--json",
        "--",
        *CMD.split(),
        "--model-path",
        str(model),
        env=NO_STORAGE_ENV,
    )
    assert out.returncode == 0, out.stderr
    ns_dir = Path(json.loads(out.stdout)["storage_dir"])
    for i in range(3):
        (ns_dir / page_name(i)).write_bytes(b"k" * 4096)
    (top / "empty").mkdir(mode=0o755)
    (top / "closed").mkdir(mode=0o700)  # another user's: not even readable
    try:
        yield top
    finally:
        shutil.rmtree(top)


@pytest.fixture(scope="module")
def read_only(shared: Path) -> Iterator[Path]:
    """The used root, bind-mounted read-only (EROFS for every write, even root's)."""
    mnt = shared / "ro"
    mnt.mkdir()
    subprocess.run(["mount", "--bind", str(shared / "used"), str(mnt)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(mnt)], check=True)
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def run(root: Path, args: list[str], *, as_nobody: bool) -> subprocess.CompletedProcess[str]:
    """`cachemgr --root ROOT ARGS` as a process (as uid 65534 if asked), with no TTY."""
    prefix = ["setpriv", "--reuid", NOBODY, "--regid", NOBODY, "--clear-groups"]
    argv = [
        *(prefix if as_nobody else []),
        sys.executable,
        "-m",
        "cachemgr",
        "--log-format",
        "json",
        "--root",
        str(root),
        *args,
    ]
    env = {**os.environ, "HOME": str(root.parent), "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": ""}
    return subprocess.run(
        argv, capture_output=True, text=True, input="", env=env, timeout=60, cwd="/"
    )


def check(out: subprocess.CompletedProcess[str], must_fail: bool) -> str | None:
    """No traceback; a failure is exactly one error line (returned); a writer must fail.
    (doctor's non-zero exit for findings is its answer, not a failure.)"""
    assert "Traceback" not in out.stderr, out.stderr
    failed = out.returncode != 0 and "doctor" not in out.args
    if must_fail or failed or "cachemgr: error:" in out.stderr:
        return one_line_error(out)
    return None


CASES = sorted(commands(Path("m")))


@pytest.mark.parametrize("name", CASES)
def test_a_root_this_user_cannot_write(shared: Path, name: str) -> None:
    args, writes = commands(shared / "model")[name]
    for root in (shared / "used", shared / "empty", shared / "closed"):
        line = check(run(root, args, as_nobody=True), writes)
        if writes:
            assert "not writable by this user (uid 65534)" in str(line), line


@pytest.mark.parametrize("name", CASES)
def test_a_read_only_filesystem(shared: Path, read_only: Path, name: str) -> None:
    args, writes = commands(shared / "model")[name]
    line = check(run(read_only, args, as_nobody=False), writes)
    if writes:
        assert "read-only filesystem" in str(line), line
        assert "not writable by this user" not in str(line)


@pytest.mark.parametrize("name", CASES)
def test_a_missing_root(shared: Path, read_only: Path, name: str) -> None:
    """Readers say there is no root; creators cannot make one on a read-only filesystem;
    fingerprint, config and doctor with a launch need no root."""
    args, writes = commands(shared / "model")[name]
    missing = read_only / "nothing-here"
    out = run(missing, args, as_nobody=False)
    line = check(out, writes)
    if name in ("init", "serve", "config --check"):  # the creators
        assert "read-only filesystem" in str(line), line
    if name not in ("fingerprint", "config", "doctor -- launch") and not writes:
        assert line == f"cachemgr: error: no cache root at {missing} (init or serve creates it)"
    assert not missing.exists()
