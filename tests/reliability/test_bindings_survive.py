"""Instance bindings survive the loss of the state DB: deleted, corrupt, or moved away, it is
rebuilt from disk with every instance still on its namespace, so GC never drops a namespace a
server uses (by rank or by TTL), and `purge --instance`, `ls`, `status`, /v1/status see the
same bindings as before. A namespace whose server moved away is still dropped (no
over-retention), and GC never drops one a running process on this host points at."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from cachemgr.layout import Layout, db_files
from cachemgr.settings import Settings
from cachemgr.sglang.hicache import STORAGE_DIR_ENV
from cachemgr.state.dbfile import file_id
from tests.daemon_helpers import RunningDaemon, running_daemon, wait_for
from tests.nsfixtures import cli, page_name
from tests.test_identity import make_model
from tests.test_init import init_json

SERVERS = {"srv-a": "bfloat16", "srv-b": "fp8_e4m3", "srv-c": "mxfp8"}
PAGES = 4
HOUR_AGO = time.time() - 3600
# GC as strict as it gets: anything unbound and idle a second is past retention.
RANK = {"CACHEMGR_GC_MIN_AGE": "1s"}  # keep_unbound stays 2: the third unbound one goes
TTL = {**RANK, "CACHEMGR_GC_UNBOUND_TTL": "10s"}  # every unbound one goes
DROP_ALL = {**RANK, "CACHEMGR_GC_KEEP_UNBOUND": "0"}


def age_root(layout: Layout) -> None:
    """Backdate every manifest's times and every page's mtime an hour: idle far past min_age,
    as namespaces of servers that have not restarted for a while are."""
    for manifest in layout.ns_root.glob("*.json"):
        data = json.loads(manifest.read_text())
        data["created_at"] = data["last_active_at"] = HOUR_AGO
        manifest.write_text(json.dumps(data))
    for page in layout.ns_root.glob("*/*.bin"):
        os.utime(page, (HOUR_AGO, HOUR_AGO))


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return make_model(tmp_path / "model")


@pytest.fixture
def servers(root: Path, model: Path) -> dict[str, str]:
    """Three instances init'ed on three namespaces with old pages: instance → namespace."""
    bound = {}
    for instance, kv in SERVERS.items():
        out = init_json(root, model, "--instance", instance, kv=kv)
        ns_dir = Path(str(out["storage_dir"]))
        for i in range(PAGES):
            (ns_dir / page_name(i, instance)).write_bytes(b"k" * 64)
        bound[instance] = ns_dir.name
    age_root(Layout.at(root))
    return bound


def delete_db(layout: Layout) -> None:
    for path in db_files(layout.db_path):
        path.unlink(missing_ok=True)


def corrupt_db(layout: Layout) -> None:
    """Random bytes over every page past the header: the schema names tables that are gone."""
    db = layout.db_path
    size = max(db.stat().st_size, 8192)
    with open(db, "r+b") as f:
        f.seek(4096)
        f.write(random.Random(7).randbytes(size - 4096))


def move_db_away(layout: Layout) -> None:
    away = layout.root.parent / "db-elsewhere"
    away.mkdir()
    for path in db_files(layout.db_path):
        if path.exists():
            shutil.move(path, away / path.name)


LOSSES: list[Callable[[Layout], None]] = [delete_db, corrupt_db, move_db_away]


def pages_in(layout: Layout, ns: str) -> int:
    return len(list(layout.ns_dir(ns).glob("*.bin"))) if layout.ns_dir(ns).is_dir() else -1


def ls_bindings(root: Path) -> dict[str, list[str]]:
    """namespace → instances, as `ls --json` shows them."""
    out = cli("--root", str(root), "ls", "--json")
    assert out.returncode == 0, out.stderr
    return {n["ns_id"]: n["instances"] for n in json.loads(out.stdout)["namespaces"]}


def expected_ls(bound: dict[str, str]) -> dict[str, list[str]]:
    return {ns: [inst] for inst, ns in bound.items()}


def gc(root: Path, env: dict[str, str]) -> dict[str, object]:
    out = cli("--root", str(root), "gc", "--yes", "--json", env={STORAGE_DIR_ENV: "", **env})
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    report: dict[str, object] = json.loads(out.stdout)
    return report


# --- the CLI ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [RANK, TTL], ids=["by-rank", "by-ttl"])
@pytest.mark.parametrize("loss", LOSSES)
def test_gc_after_a_lost_db_drops_no_bound_namespace(
    root: Path, servers: dict[str, str], loss: Callable[[Layout], None], policy: dict[str, str]
) -> None:
    layout = Layout.at(root)
    assert ls_bindings(root) == expected_ls(servers)
    loss(layout)
    gc(root, policy)
    assert {ns: pages_in(layout, ns) for ns in servers.values()} == dict.fromkeys(
        servers.values(), PAGES
    )
    assert all(layout.manifest(ns).is_file() for ns in servers.values())
    assert ls_bindings(root) == expected_ls(servers)
    out = cli("--root", str(root), "status", "--json", "--port", "1")
    assert {n["id"]: n["instances"] for n in json.loads(out.stdout)["namespaces"]} == (
        expected_ls(servers)
    )


@pytest.mark.parametrize("loss", LOSSES)
def test_purge_instance_after_a_lost_db_purges_its_namespace(
    root: Path, servers: dict[str, str], loss: Callable[[Layout], None]
) -> None:
    layout = Layout.at(root)
    loss(layout)
    out = cli("--root", str(root), "purge", "--instance", "srv-b", "--yes", "--json")
    assert out.returncode == 0, out.stderr
    assert [t["ns_id"] for t in json.loads(out.stdout)["plan"]["targets"]] == [servers["srv-b"]]
    assert {inst: pages_in(layout, ns) for inst, ns in servers.items()} == {
        "srv-a": PAGES,
        "srv-b": 0,
        "srv-c": PAGES,
    }
    assert ls_bindings(root) == expected_ls(servers)  # purged while bound: still bound


def test_a_namespace_whose_server_moved_away_is_still_dropped(
    root: Path, model: Path, servers: dict[str, str]
) -> None:
    layout = Layout.at(root)
    moved = init_json(root, model, "--instance", "srv-a", "--on-change", "retain", kv="fp8_e5m2")
    assert moved["old_action"] == "retained"
    now_on = {**servers, "srv-a": str(moved["ns_id"])}
    delete_db(layout)
    gc(root, DROP_ALL)
    old = servers["srv-a"]
    assert not layout.ns_dir(old).exists() and not layout.manifest(old).exists()
    assert ls_bindings(root) == expected_ls(now_on)
    assert all(pages_in(layout, now_on[i]) == PAGES for i in ("srv-b", "srv-c"))


@pytest.fixture
def user_of(root: Path) -> Iterator[Callable[[Path], subprocess.Popen[bytes]]]:
    """Start a process whose SGLang storage dir is the given one (as a server's would be)."""
    started: list[subprocess.Popen[bytes]] = []

    def start(ns_dir: Path) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(["sleep", "300"], env={**os.environ, STORAGE_DIR_ENV: str(ns_dir)})
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_gc_never_drops_a_namespace_a_running_process_uses(
    root: Path,
    model: Path,
    servers: dict[str, str],
    user_of: Callable[[Path], subprocess.Popen[bytes]],
) -> None:
    layout = Layout.at(root)
    init_json(root, model, "--instance", "srv-a", "--on-change", "retain", kv="fp8_e5m2")
    old = servers["srv-a"]  # unbound now, but a server started before still writes it
    server = user_of(layout.ns_dir(old))
    wait_for(
        lambda: (Path("/proc") / str(server.pid) / "environ").read_bytes(),
        lambda env: str(layout.ns_dir(old)).encode() in env,
    )
    delete_db(layout)  # rebuilt from disk: the times GC goes by are the manifests' (old)
    report = gc(root, DROP_ALL)
    steps = [s for s in report["steps"] if s["namespace_id"] == old]  # type: ignore[attr-defined]
    assert [s["skipped"] for s in steps] == [
        f"a running process uses it as its storage dir (pid {server.pid})"
    ]
    assert pages_in(layout, old) == PAGES
    server.kill()
    server.wait()
    gc(root, DROP_ALL)
    assert not layout.ns_dir(old).exists()


def test_bindings_of_an_older_root_are_written_down_before_the_db_is_lost(
    root: Path, servers: dict[str, str]
) -> None:
    """A root whose bindings only its DB knows (written by an older cachemgr): the next
    command that writes (init, purge, gc, the daemon; never a reading one) writes them beside
    the manifests, so a later loss of the DB keeps them."""
    layout = Layout.at(root)
    files = {inst: layout.binding(inst) for inst in servers}
    for path in files.values():
        path.unlink()
    assert ls_bindings(root) == expected_ls(servers)
    assert not any(path.exists() for path in files.values())  # ls only read
    assert cli("--root", str(root), "gc", "--yes").returncode == 0
    assert all(path.is_file() for path in files.values())
    delete_db(layout)
    assert ls_bindings(root) == expected_ls(servers)


def test_the_db_wins_over_a_stale_binding_file(root: Path, servers: dict[str, str]) -> None:
    """A file left naming another namespace (an init that crashed before its DB commit, an
    older cachemgr that rebound in the DB only) is rewritten from the DB."""
    layout = Layout.at(root)
    path = layout.binding("srv-a")
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "ns_id": servers["srv-b"]}))
    assert ls_bindings(root) == expected_ls(servers)
    assert cli("--root", str(root), "gc", "--yes").returncode == 0
    assert json.loads(path.read_text())["ns_id"] == servers["srv-a"]


# --- the daemon ------------------------------------------------------------------------------


def serving_bindings(d: RunningDaemon) -> dict[str, list[str]]:
    return {ns["id"]: ns["instances"] for ns in d.status()["namespaces"]}


def gc_after_now(d: RunningDaemon) -> list[dict[str, object]]:
    """The steps of a GC run that started after this call (a request may join a run already
    under way, so the second one is the first surely started after)."""
    for _ in range(2):
        r = d.post("/v1/gc")
        assert r.status_code == 200, r.text
    steps: list[dict[str, object]] = r.json()["steps"]
    return steps


@pytest.mark.parametrize(
    "under_it", [True, False], ids=["deleted-while-running", "corrupt-at-start"]
)
def test_the_daemon_rebuilds_bindings_and_its_gc_keeps_them(
    root: Path, settings: Settings, servers: dict[str, str], under_it: bool
) -> None:
    layout = Layout.at(root)
    fast = settings.model_copy(
        update={
            "batch_interval": 0.05,
            "gc_interval": timedelta(seconds=0.2),
            "gc_sweep_interval": timedelta(seconds=0.2),
            "gc_min_age": timedelta(seconds=1),
            "gc_unbound_ttl": timedelta(seconds=10),
        }
    )
    if not under_it:
        corrupt_db(layout)
    with running_daemon(fast) as d:
        if under_it:
            wait_for(lambda: serving_bindings(d), lambda got: got == expected_ls(servers))
            before = file_id(layout.db_path)
            delete_db(layout)
            wait_for(lambda: file_id(layout.db_path), lambda got: got not in (None, before))
        wait_for(lambda: serving_bindings(d), lambda got: got == expected_ls(servers))
        steps = gc_after_now(d)
        assert not [s for s in steps if s["namespace_id"] in servers.values()]
        assert {ns: pages_in(layout, ns) for ns in servers.values()} == dict.fromkeys(
            servers.values(), PAGES
        )


def test_damaged_binding_files_are_rewritten_from_the_db_or_reported(
    root: Path, servers: dict[str, str], victim: Path
) -> None:
    """A FIFO or a link where a binding file goes is replaced from the DB, never opened or
    followed; a bad file of an instance the DB does not know is reported by doctor."""
    layout = Layout.at(root)
    layout.binding("srv-a").unlink()
    os.mkfifo(layout.binding("srv-a"))
    layout.binding("srv-b").unlink()
    layout.binding("srv-b").symlink_to(victim / "precious.txt")
    layout.binding("ghost").write_text('{"version": 1, "instance": "ghost", "ns_id": "../x"}')
    assert ls_bindings(root) == expected_ls(servers)
    assert cli("--root", str(root), "gc", "--yes").returncode == 0  # a writer repairs them
    for inst in ("srv-a", "srv-b"):
        path = layout.binding(inst)
        assert not path.is_symlink() and json.loads(path.read_text())["ns_id"] == servers[inst]
    out = cli("--root", str(root), "doctor", "--json")
    found = [f for f in json.loads(out.stdout) if f["code"] == "binding-unreadable"]
    assert [f["message"] for f in found] == [
        f"{layout.binding('ghost')}: ns_id '../x' is not a namespace id"
    ]
    delete_db(layout)
    assert ls_bindings(root) == expected_ls(servers)
