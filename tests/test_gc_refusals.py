"""Pages GC may not delete are loud: the daemon's runner counts a short run and the refused
files by reason (the metric), `cachemgr gc` exits 1 with the warning, and `doctor` finds the
pages GC's user cannot delete. (With real engines and real users: test_deploy_vllm_users.py.)"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from cachemgr.daemon.metrics import CachemgrCollector, Parts
from cachemgr.fs.deletecheck import files_of, reason_of
from cachemgr.fs.deletion import delete_files
from cachemgr.fs.leadership import Leadership
from cachemgr.gc.runner import GcRunner
from tests.gc_helpers import NS, NS2, T0, Tree, big_disk, page, policy
from tests.nsfixtures import cli
from tests.users import User, as_user, needs_root


@contextmanager
def immutable(path: Path) -> Iterator[None]:
    """chattr +i: EPERM on unlink even for root (what another user's dir is to the daemon)."""
    subprocess.run(["chattr", "+i", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_a_refused_page_makes_a_short_run_and_feeds_the_metric(root: Path) -> None:
    tree = Tree.at(root)
    names = [page(i) for i in range(4)]
    tree.write(NS, names, at=T0, size=1000)
    runner = GcRunner(tree.layout, tree.store, policy(max_bytes=1), disk_usage=big_disk)

    @contextmanager
    def reader() -> Iterator[sqlite3.Connection]:
        yield tree.store.conn

    reg = CollectorRegistry(auto_describe=False)
    reg.register(CachemgrCollector(tree.layout, reader, Parts(gc=runner)))
    before = runner.stats.last_success
    with immutable(tree.dir(NS) / names[0]):
        report = runner.run(actor="auto")
    assert not report.held and tree.files(NS) == {names[0]}
    assert any("cannot be deleted by uid 0 (1 permission)" in w for w in report.warnings)
    v = reg.get_sample_value
    assert v("cachemgr_gc_refused_files_total", {"reason": "permission"}) == 1
    assert v("cachemgr_gc_refused_files_total", {"reason": "not_ours"}) == 0
    assert v("cachemgr_gc_runs_total", {"result": "short"}) == 1
    assert v("cachemgr_gc_runs_total", {"result": "ok"}) == 0
    assert runner.stats.last_success == before  # a short run is no success
    runner.leadership.release()
    tree.store.close()


def test_gc_cli_exits_1_when_the_cap_is_not_held(root: Path) -> None:
    tree = Tree.at(root)
    names = [page(i) for i in range(4)]
    tree.write(NS, names, at=T0, size=1000)
    tree.store.close()
    with immutable(tree.dir(NS) / names[1]):
        out = cli(
            "--root", str(root), "gc", "--yes", "--json", "--max-bytes", "1", "--min-age", "0"
        )
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert report["held"] is False
    assert report["warnings"][0].startswith(f"1 files in ns/{NS} cannot be deleted by uid 0")
    assert "cachemgr: error: the limit was not held: 1 files" in out.stderr
    assert "Traceback" not in out.stderr


@needs_root
def test_doctor_finds_pages_gc_user_cannot_delete(root: Path) -> None:
    """GC's user is the uid in the GC lock, in the root's group (the deploy's setgid root); a
    namespace dir of another uid without the group's write (a writer's umask 022) is a
    finding, a group-writable one is not."""
    tree = Tree.at(root)
    tree.write(NS, [page(i) for i in range(3)], at=T0)
    tree.write(NS2, [page(i) for i in range(3)], at=T0)
    tree.store.close()
    gc_uid, gc_gid, writer = 23011, 23011, 23012
    os.chown(root, 0, gc_gid)
    lock = Leadership(tree.layout.gc_lock)
    assert lock.try_acquire()
    lock.release()
    tree.layout.gc_lock.write_text(f"pid 1 uid {gc_uid} on host since then\n")
    for ns, mode in ((NS, 0o2755), (NS2, 0o2775)):
        os.chown(tree.dir(ns), writer, gc_gid)
        os.chmod(tree.dir(ns), mode)
    out = cli("--root", str(root), "doctor", "--json")
    findings = [f for f in json.loads(out.stdout) if f["code"] == "gc-cannot-delete"]
    assert out.returncode == 2, out.stdout
    (finding,) = findings
    assert finding["message"].startswith(
        f"3 pages in ns {NS} cannot be deleted by uid {gc_uid} (GC's user): "
        f"{tree.dir(NS)} is mode 2755, uid {writer}, gid {gc_gid}"
    )
    assert "the writer's umask is 022" in finding["message"]
    assert f"chmod -R g+w {tree.dir(NS)}" in finding["fix"]


def test_an_immutable_page_is_not_blamed_on_the_umask(root: Path) -> None:
    """chattr +i refuses even root (EPERM): the group-write fix would not help, so the warning
    names what does (lsattr / chattr -i, or a sticky dir's owner)."""
    tree = Tree.at(root)
    names = [page(i) for i in range(2)]
    tree.write(NS, names, at=T0, size=1000)
    tree.store.close()
    with immutable(tree.dir(NS) / names[0]):
        out = cli("--root", str(root), "gc", "--yes", "--json", "--max-bytes", "1")
    assert out.returncode == 1, out.stderr
    (warning,) = json.loads(out.stdout)["warnings"]
    assert "Operation not permitted" in warning and "umask" not in warning
    assert "chattr -i" in warning and "chmod -t" in warning


def _gc_ran_as(tree: Tree, uid: int) -> None:
    lock = Leadership(tree.layout.gc_lock)
    assert lock.try_acquire()
    lock.release()
    tree.layout.gc_lock.write_text(f"pid 1 uid {uid} on host since then\n")


def _cannot_delete(root: Path) -> list[dict[str, str]]:
    out = cli("--root", str(root), "doctor", "--json")
    found = [f for f in json.loads(out.stdout) if f["code"] == "gc-cannot-delete"]
    assert out.returncode == (2 if found else out.returncode), out.stdout
    return found


@needs_root
def test_doctor_finds_an_immutable_page_even_for_root(root: Path) -> None:
    """GC refuses it every run (EPERM, whoever deletes): doctor must not say all is well."""
    tree = Tree.at(root)
    names = [page(i) for i in range(3)]
    tree.write(NS, names, at=T0)
    tree.store.close()
    _gc_ran_as(tree, 0)
    with immutable(tree.dir(NS) / names[1]):
        (finding,) = _cannot_delete(root)
    assert finding["message"].startswith(f"1 pages in ns {NS} cannot be deleted by uid 0")
    assert "immutable or append-only" in finding["message"] and "umask" not in finding["message"]
    assert "chattr -i -a" in finding["fix"]
    assert _cannot_delete(root) == []  # flag cleared: nothing found


@needs_root
def test_doctor_names_a_sticky_dir_not_the_umask(root: Path) -> None:
    """A sticky dir of uid A, pages of writer B, GC as C in the group: group write is there
    (mode 3777), so `chmod g+w` would not help; the sticky bit is the cause."""
    tree = Tree.at(root)
    tree.write(NS, [page(i) for i in range(2)], at=T0)
    tree.store.close()
    gc_uid, owner, writer = 23021, 23022, 23023
    os.chown(root, 0, gc_uid)
    _gc_ran_as(tree, gc_uid)
    os.chown(tree.dir(NS), owner, gc_uid)
    os.chmod(tree.dir(NS), 0o3777)
    for f in tree.dir(NS).iterdir():
        os.chown(f, writer, gc_uid)
    (finding,) = _cannot_delete(root)
    assert "sticky" in finding["message"] and "umask" not in finding["message"]
    assert f"chmod -t {tree.dir(NS)}" in finding["fix"]


def _refusals(root: Path, names: list[str], *, dry_run: bool) -> tuple[int, dict[str, int]]:
    """Files deleted (or that a dry run says would be) and refused, by reason, of one
    deletion of `names` in ns/<NS>."""
    report = delete_files(root, f"ns/{NS}", names, dry_run=dry_run)
    by_reason: dict[str, int] = {}
    for refusal in report.refused:
        by_reason[reason_of(refusal)] = by_reason.get(reason_of(refusal), 0) + files_of(refusal)
    return report.files, by_reason


def test_a_dry_run_refuses_the_immutable_page_the_real_run_keeps(root: Path) -> None:
    """chattr +i (and +a) refuse the unlink even to root: the dry run says so file by file,
    so it counts exactly what the real run deletes (a cap it cannot hold reads as one)."""
    tree = Tree.at(root)
    names = [page(i) for i in range(4)]
    tree.write(NS, names, at=T0, size=1000)
    tree.store.close()
    with immutable(tree.dir(NS) / names[1]):
        subprocess.run(["chattr", "+a", str(tree.dir(NS) / names[2])], check=True)
        try:
            dry = _refusals(root, names, dry_run=True)
            assert tree.files(NS) == set(names)  # the dry run deleted nothing
            real = _refusals(root, names, dry_run=False)
        finally:
            subprocess.run(["chattr", "-a", str(tree.dir(NS) / names[2])], check=True)
    assert dry == real == (2, {"permission": 2})
    assert tree.files(NS) == {names[1], names[2]}


def test_a_dry_run_refuses_the_pages_of_an_append_only_dir(root: Path) -> None:
    """chattr +a on the namespace dir: new names may come, none may go, even for root; the
    dir is writable to faccessat, so the dry run asks for the dir's flag too."""
    tree = Tree.at(root)
    names = [page(i) for i in range(3)]
    tree.write(NS, names, at=T0, size=1000)
    tree.store.close()
    subprocess.run(["chattr", "+a", str(tree.dir(NS))], check=True)
    try:
        dry = _refusals(root, names, dry_run=True)
        real = _refusals(root, names, dry_run=False)
    finally:
        subprocess.run(["chattr", "-a", str(tree.dir(NS))], check=True)
    assert dry == real == (0, {"permission": 3})
    assert tree.files(NS) == set(names)


def _sticky(root: Path) -> tuple[Tree, list[str], User]:
    """A sticky dir of uid A (mode 3777: group write is there), pages of writer B and one of
    GC's own user C (returned, with the pages' names)."""
    tree = Tree.at(root)
    names = [page(i) for i in range(3)]
    tree.write(NS, names, at=T0, size=1000)
    tree.store.close()
    gc_uid, owner, writer = 23031, 23032, 23033
    os.chmod(root, 0o755)
    os.chmod(tree.layout.ns_root, 0o755)
    os.chown(tree.dir(NS), owner, gc_uid)
    os.chmod(tree.dir(NS), 0o3777)
    for name in names[1:]:
        os.chown(tree.dir(NS) / name, writer, gc_uid)
    os.chown(tree.dir(NS) / names[0], gc_uid, gc_uid)
    return tree, names, User(gc_uid, (gc_uid,))


@needs_root
def test_a_dry_run_refuses_another_owners_page_in_a_sticky_dir(root: Path) -> None:
    """C may unlink only its own page in the sticky dir (the kernel's sticky check), and its
    dry run says the same before the real run does it."""
    tree, names, gc_user = _sticky(root)
    dry = as_user(gc_user, lambda: _refusals(root, names, dry_run=True))
    assert tree.files(NS) == set(names)
    real = as_user(gc_user, lambda: _refusals(root, names, dry_run=False))
    assert dry == real == (1, {"permission": 2})
    assert tree.files(NS) == set(names[1:])


@needs_root
def test_a_dry_run_asks_for_cap_fowner_as_the_user_it_now_is(root: Path) -> None:
    """root's dry run may unlink anyone's page in a sticky dir (CAP_FOWNER); a process that
    drops to a user without it afterwards (a fork that sets its uid, as a service started as
    root does) is refused those pages, and its dry run must say so: not root's answer kept
    from before."""
    tree, names, gc_user = _sticky(root)
    assert _refusals(root, names, dry_run=True) == (3, {})  # root, with CAP_FOWNER
    dry = as_user(gc_user, lambda: _refusals(root, names, dry_run=True))
    assert dry == (1, {"permission": 2})
    assert tree.files(NS) == set(names)


_IN_A_USER_NAMESPACE = """
import json, sys
from pathlib import Path
from cachemgr.fs.deletecheck import files_of
from cachemgr.fs.deletion import delete_files
root, rel, names = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
out = {}
for dry in (True, False):
    report = delete_files(root, rel, names, dry_run=dry)
    out["dry" if dry else "real"] = [report.files, sum(map(files_of, report.refused))]
print(json.dumps(out))
"""


@needs_root
def test_a_dry_run_in_a_user_namespace_refuses_a_page_of_an_unmapped_owner(root: Path) -> None:
    """Root in a user namespace (a rootless container: `unshare -U -r`) has CAP_FOWNER there,
    but the kernel lets it pass the sticky rule only for a file whose uid and gid the namespace
    maps: another writer's page (shown as the overflow uid) is refused, in the dry run too."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    tree, names, _ = _sticky(root)
    argv = ["unshare", "-U", "-r", sys.executable, "-c", _IN_A_USER_NAMESPACE]
    out = subprocess.run(
        [*argv, str(root), f"ns/{NS}", *names], capture_output=True, text=True, check=False
    )
    if out.returncode != 0 and "unshare failed" in out.stderr:
        pytest.skip(f"no user namespaces here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    # Two pages of writer B and one of C, none of them mapped in the namespace: each refused.
    assert json.loads(out.stdout) == {"dry": [0, 3], "real": [0, 3]}
    assert tree.files(NS) == set(names)
