"""`cachemgr init` and `cachemgr exec` on real model dirs, real roots, real child processes."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cachemgr import engines
from cachemgr.cli.envfile import HEADER, is_ours
from cachemgr.layout import Layout
from cachemgr.ns.registry import binding_of
from cachemgr.state.store import Store
from tests.nsfixtures import cli, cli_process, one_line_error, page_name, snapshot
from tests.test_identity import make_model

CMD = "sglang serve --enable-hierarchical-cache --hicache-storage-backend file --page-size 64"
NO_STORAGE_ENV = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": ""}


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return make_model(tmp_path / "model")


def init(
    root: Path, model: Path, *extra: str, kv: str = "bfloat16", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`cachemgr init … -- sglang serve --model-path M --kv-cache-dtype KV …`."""
    launch = [*CMD.split(), "--model-path", str(model), "--kv-cache-dtype", kv]
    return cli("--root", str(root), "init", *extra, "--", *launch, env=env or NO_STORAGE_ENV)


def init_json(root: Path, model: Path, *extra: str, kv: str = "bfloat16") -> dict[str, object]:
    out = init(root, model, "--json", *extra, kv=kv)
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    return result


def audit(root: Path) -> list[tuple[str, str, str, int]]:
    store = Store.open(Layout.at(root).db_path)
    try:
        rows = store.conn.execute("SELECT action, reason, actor, pages FROM audit ORDER BY id")
        return [tuple(r) for r in rows]  # type: ignore[misc]
    finally:
        store.close()


def fill(ns_dir: Path, n: int) -> None:
    for i in range(n):
        (ns_dir / page_name(i)).write_bytes(b"k" * 10)


def test_first_run_creates_namespace_and_manifest(root: Path, model: Path) -> None:
    out = init(root, model)
    assert out.returncode == 0, out.stderr
    (ns,) = [p.name for p in (root / "ns").iterdir() if p.is_dir()]
    assert out.stdout.strip() == f"created ns {ns} for instance default: {root / 'ns' / ns}"
    manifest = json.loads((root / "ns" / f"{ns}.json").read_text())
    assert manifest["identity"]["kv_cache_dtype"] == "bfloat16"
    assert manifest["identity"]["page_size"] == 64
    assert manifest["digest"].startswith(ns) and manifest["cachemgr_version"]
    assert manifest["created_at"] <= manifest["last_active_at"]
    store = Store.open(Layout.at(root).db_path)
    assert binding_of(store, "default") == ns
    store.close()


def test_unchanged_identity_is_a_no_op(root: Path, model: Path) -> None:
    first = init_json(root, model)
    ns_dir = Path(str(first["storage_dir"]))
    fill(ns_dir, 4)
    before = snapshot(ns_dir)
    out = init(root, model)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"identity unchanged: ns {first['ns_id']}, nothing to do"
    again = init_json(root, model)
    assert again["outcome"] == "unchanged" and again["storage_dir"] == str(ns_dir)
    assert snapshot(ns_dir) == before
    assert audit(root) == []
    assert os.listdir(root / ".trash") == []


def test_identity_change_purges_the_old_namespace(root: Path, model: Path) -> None:
    a = init_json(root, model)
    fill(Path(str(a["storage_dir"])), 5)
    out = init(root, model, kv="fp8_e4m3")
    assert out.returncode == 0, out.stderr
    b_ns = [p.name for p in (root / "ns").iterdir() if p.is_dir()]
    assert len(b_ns) == 1 and b_ns[0] != a["ns_id"]
    assert out.stdout.strip() == (
        f"identity changed (kv_cache_dtype: bfloat16 → fp8_e4m3): purged ns {a['ns_id']} "
        f"(5 pages, 50 B); now ns {b_ns[0]}"
    )
    assert not (root / "ns" / f"{a['ns_id']}.json").exists()
    assert os.listdir(root / ".trash") == []  # --wait is the default
    assert audit(root) == [
        ("purge", "identity_change", "cli", 5),
        ("delete-trash", "trash", "cli", 5),
    ]


def test_retain_keeps_the_old_namespace_for_a_switch_back(root: Path, model: Path) -> None:
    a = init_json(root, model)
    fill(Path(str(a["storage_dir"])), 2)
    b = init_json(root, model, "--on-change", "retain", kv="fp8_e4m3")
    assert (b["outcome"], b["old_action"], b["old_pages"]) == ("changed", "retained", 2)
    back = init_json(root, model, "--on-change", "retain")
    assert back["ns_id"] == a["ns_id"] and back["outcome"] == "changed"
    assert len(os.listdir(Path(str(a["storage_dir"])))) == 2  # the pages are still there
    assert audit(root) == []


def test_two_instances_coexist_and_a_shared_old_namespace_is_kept(root: Path, model: Path) -> None:
    one = init_json(root, model, "--instance", "one")
    two = init_json(root, model, "--instance", "two", kv="fp8_e4m3")
    assert one["ns_id"] != two["ns_id"]
    fill(Path(str(one["storage_dir"])), 3)
    fill(Path(str(two["storage_dir"])), 3)
    keep = snapshot(Path(str(two["storage_dir"])))
    # "three" joins one's namespace, then moves away: one still uses it, so it stays.
    assert init_json(root, model, "--instance", "three")["outcome"] == "joined"
    moved = init_json(root, model, "--instance", "three", kv="fp8_e5m2")
    assert (moved["old_action"], moved["old_users"]) == ("kept", ["one"])
    assert len(os.listdir(Path(str(one["storage_dir"])))) == 3
    out = cli("--root", str(root), "purge", "--instance", "one", "--yes")
    assert out.returncode == 0, out.stderr
    assert os.listdir(Path(str(one["storage_dir"]))) == []  # recreated empty: one is bound
    assert snapshot(Path(str(two["storage_dir"]))) == keep


def test_print_env_and_env_file(root: Path, model: Path, tmp_path: Path) -> None:
    env_file = tmp_path / "hicache.env"
    out = init(root, model, "--print-env", "--env-file", str(env_file))
    assert out.returncode == 0, out.stderr
    (ns,) = [p.name for p in (root / "ns").iterdir() if p.is_dir()]
    line = f"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR={root / 'ns' / ns}"
    assert out.stdout == line + "\n"
    assert env_file.read_text() == HEADER + line + "\n"
    assert "created ns" in out.stderr
    assert [p.name for p in tmp_path.iterdir() if "tmp" in p.name] == []  # no temp left
    again = init(root, model, "--env-file", str(env_file))  # its own file: replaced
    assert again.returncode == 0, again.stderr
    assert env_file.read_text() == HEADER + line + "\n"


def test_an_env_file_init_wrote_before_it_had_a_header_is_replaced(
    root: Path, model: Path, tmp_path: Path
) -> None:
    env_file = tmp_path / "hicache.env"
    env_file.write_text("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=/srv/cache/ns/0123456789abcdef\n")
    out = init(root, model, "--env-file", str(env_file))
    assert out.returncode == 0, out.stderr
    assert env_file.read_text().startswith(HEADER + "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=")


@pytest.mark.parametrize("what", ["device", "symlink", "foreign-file"])
def test_an_env_file_path_holding_what_init_did_not_write_is_refused_before_anything(
    root: Path, model: Path, tmp_path: Path, what: str
) -> None:
    """A device node, a link, or the operator's own env file (SGLANG_ARGS in
    /etc/sglang/sglang.env) at --env-file was replaced by a regular file without a word."""
    path = tmp_path / "env"
    theirs = "SGLANG_ARGS='--tp 8'\nSGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=/srv/c\n"
    if what == "device":
        if os.geteuid() != 0:
            pytest.skip("mknod needs root (CI runs as root)")
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 7))  # as /dev/full
    elif what == "symlink":
        (tmp_path / "target").write_text(theirs)
        path.symlink_to(tmp_path / "target")
    else:
        path.write_text(theirs)
    before = os.lstat(path)
    out = init(root, model, "--env-file", str(path))
    assert out.returncode == 2, out.stderr
    line = one_line_error(out)
    kind = {"device": "a character device", "symlink": "a symlink"}.get(what)
    said = f"is {kind}, not a file cachemgr init wrote" if kind else "cachemgr init did not write"
    assert said in line and "not replaced" in line, line
    after = os.lstat(path)
    assert (after.st_ino, after.st_mode, after.st_size) == (
        before.st_ino,
        before.st_mode,
        before.st_size,
    )
    assert not root.exists()  # refused before the root, the identity, any purge


def test_an_env_file_in_a_missing_dir_is_refused_before_anything_is_made(
    root: Path, model: Path, tmp_path: Path
) -> None:
    out = init(root, model, "--env-file", str(tmp_path / "no-such-dir" / "hicache.env"))
    assert out.returncode == 2
    assert "is not a directory" in one_line_error(out)
    assert not root.exists()


def test_storage_dir_env_pointing_elsewhere_warns(root: Path, model: Path) -> None:
    out = init(root, model, env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": "/srv/old"})
    assert out.returncode == 0, out.stderr
    assert (
        "warning: environment variable SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR is set to "
        "/srv/old; SGLang reads it before anything else" in out.stderr
    )


def test_extra_config_storage_path_warns(root: Path, model: Path) -> None:
    extra = json.dumps({"file_storage_path": "/srv/hicache"})
    out = init(root, model, "--hicache-storage-backend-extra-config", extra)
    # The launch command is everything after `--`: put the flag there.
    assert out.returncode != 0  # init has no such option: it belongs to the launch command
    launch = [
        *CMD.split(),
        "--model-path",
        str(model),
        "--hicache-storage-backend-extra-config",
        extra,
    ]
    out = cli("--root", str(root), "init", "--", *launch, env=NO_STORAGE_ENV)
    assert out.returncode == 0, out.stderr
    assert "file_storage_path is /srv/hicache: SGLang uses it unless" in out.stderr


def test_extra_config_that_is_not_json_is_one_line(root: Path, model: Path) -> None:
    launch = [
        *CMD.split(),
        "--model-path",
        str(model),
        "--hicache-storage-backend-extra-config",
        "{file_storage_path: /srv}",
    ]
    out = cli("--root", str(root), "init", "--", *launch, env=NO_STORAGE_ENV)
    assert "--hicache-storage-backend-extra-config is not a JSON object" in one_line_error(out)
    assert not Layout.at(root).ns_root.exists() or not any(Layout.at(root).ns_root.iterdir())


@pytest.mark.parametrize("bad", ['"abc"', '"8"', "1.5", "[1]", '{"a": 1}'])
def test_a_tp_lcm_size_that_is_no_whole_number_is_one_line(
    root: Path, model: Path, bad: str
) -> None:
    """SGLang computes `tp_lcm_size % tp_size` with the JSON value: a string fails its start,
    1.5 its assertion (was a ValueError or TypeError traceback, exit 1, or taken as 8 and 1)."""
    extra = f'{{"tp_lcm_size": {bad}}}'
    launch = [*CMD.split(), "--model-path", str(model)]
    launch += ["--hicache-storage-backend-extra-config", extra]
    out = cli("--root", str(root), "init", "--", *launch, env=NO_STORAGE_ENV)
    assert "tp_lcm_size in --hicache-storage-backend-extra-config" in one_line_error(out)
    assert out.returncode == 2
    assert not Layout.at(root).ns_root.exists() or not any(Layout.at(root).ns_root.iterdir())


CHILD = textwrap.dedent("""
    import os, signal, sys
    print(os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"], os.getpid(), sys.argv[1:])
    sys.stdout.flush()
    if os.environ.get("DIE_BY") == "TERM":
        os.kill(os.getpid(), signal.SIGTERM)
    sys.exit(int(os.environ.get("EXIT_WITH", "0")))
""")


def run_exec(
    root: Path,
    model: Path,
    tmp_path: Path,
    env: dict[str, str],
    prefix: tuple[str, ...] = (),
    page_size: int = 64,
) -> tuple[subprocess.Popen[str], str, str]:
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cachemgr",
            "--root",
            str(root),
            "exec",
            "--",
            *prefix,
            sys.executable,
            str(child),
            "--model-path",
            str(model),
            "--page-size",
            str(page_size),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **NO_STORAGE_ENV, **env},
    )
    out, err = proc.communicate(timeout=60)
    return proc, out, err


def test_exec_becomes_the_server(root: Path, model: Path, tmp_path: Path) -> None:
    proc, out, err = run_exec(root, model, tmp_path, {"EXIT_WITH": "7"})
    assert proc.returncode == 7, err
    storage, pid, argv = out.split(" ", 2)
    (ns,) = [p.name for p in (root / "ns").iterdir() if p.is_dir()]
    assert storage == str(root / "ns" / ns)
    assert int(pid) == proc.pid  # the same process: cachemgr replaced itself
    assert "--model-path" in argv
    assert f"created ns {ns}" in err


def test_exec_passes_the_servers_signal_death_through(
    root: Path, model: Path, tmp_path: Path
) -> None:
    proc, _, err = run_exec(root, model, tmp_path, {"DIE_BY": "TERM"})
    assert proc.returncode == -signal.SIGTERM, err


def test_exec_refuses_a_foreign_storage_dir_env(root: Path, model: Path, tmp_path: Path) -> None:
    proc, out, err = run_exec(
        root, model, tmp_path, {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": "/srv/elsewhere"}
    )
    assert proc.returncode == 2 and out == ""
    assert err.strip().splitlines()[-1].startswith("cachemgr: error: environment variable")


def test_exec_refuses_a_foreign_storage_dir_set_in_the_launch_itself(
    root: Path, model: Path, tmp_path: Path
) -> None:
    """`env VAR=/x sglang …` sets it over what exec hands the server: SGLang would write to /x
    while cachemgr reported the namespace (was exit 0, the server started)."""
    first, out, _ = run_exec(root, model, tmp_path, {})
    old = out.split(" ", 1)[0]
    prefix = ("env", "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=/srv/elsewhere")
    # another identity: the refusal comes before init, which would have purged the old one
    proc, out, err = run_exec(root, model, tmp_path, {}, prefix, page_size=32)
    assert first.returncode == 0 and proc.returncode == 2 and out == "", err
    last = err.strip().splitlines()[-1]
    assert last.startswith("cachemgr: error: environment variable") and "/srv/elsewhere" in last
    assert Path(old).is_dir() and [p for p in (root / "ns").iterdir() if p.is_dir()] == [Path(old)]


def test_exec_takes_the_namespace_dir_set_in_the_launch_itself(
    root: Path, model: Path, tmp_path: Path
) -> None:
    """The same variable naming the namespace dir exec would hand: no conflict, it runs."""
    first, out, _ = run_exec(root, model, tmp_path, {"EXIT_WITH": "0"})
    ns_dir = out.split(" ", 1)[0]
    prefix = ("env", f"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR={ns_dir}")
    proc, out, err = run_exec(root, model, tmp_path, {}, prefix)
    assert (first.returncode, proc.returncode) == (0, 0), err
    assert out.split(" ", 1)[0] == ns_dir


def test_exec_points_a_stale_namespace_in_the_launch_at_the_new_one(
    root: Path, model: Path, tmp_path: Path
) -> None:
    """A script that names the dir an earlier init printed: the identity changed, that
    namespace was purged, and the command's own env would have sent the server into it."""
    _, out, _ = run_exec(root, model, tmp_path, {})
    old = out.split(" ", 1)[0]
    prefix = ("env", f"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR={old}")
    proc, out, err = run_exec(root, model, tmp_path, {}, prefix, page_size=32)
    assert proc.returncode == 0, err
    new = out.split(" ", 1)[0]
    assert new != old and Path(new).parent == root / "ns" and Path(new).is_dir()


def test_exec_without_a_command_is_one_line(root: Path, model: Path) -> None:
    out = cli("--root", str(root), "exec", "--model-path", str(model))
    assert "needs the server command" in one_line_error(out)


@pytest.mark.parametrize("bad", ["../x", "a/b", ""])
def test_hostile_instance_names_are_refused(root: Path, model: Path, bad: str) -> None:
    out = init(root, model, "--instance", bad)
    assert "invalid instance name" in one_line_error(out)


def test_init_on_a_symlinked_or_impossible_root_is_one_line(tmp_path: Path, model: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    assert "is a symlink" in one_line_error(init(tmp_path / "link", model))
    (tmp_path / "file").write_text("")
    assert "cannot use root" in one_line_error(init(tmp_path / "file" / "root", model))
    assert os.listdir(real) == []


def test_a_refused_trash_entry_warns_and_init_still_succeeds(root: Path, model: Path) -> None:
    a = init_json(root, model)
    fill(Path(str(a["storage_dir"])), 2)
    (Path(str(a["storage_dir"])) / "link").symlink_to(model)  # not ours to delete
    for kv in ("fp8_e4m3", "fp8_e5m2"):  # the leftover must not fail every later init
        out = init(root, model, kv=kv)
        assert out.returncode == 0, out.stderr
        (warning,) = [ln for ln in out.stderr.splitlines() if ".trash/" in ln]
        assert warning.startswith("cachemgr: warning: ")
        assert "entries in .trash/ were left alone" in warning and "link" in warning
        assert "remove them by hand" in warning
    assert model.is_dir() and any(model.iterdir())


def test_exec_of_a_missing_program_fails_before_touching_the_cache(root: Path, model: Path) -> None:
    a = init_json(root, model)
    fill(Path(str(a["storage_dir"])), 3)
    before = snapshot(root / "ns")
    # A changed identity (fp8) would purge a's namespace if init ran first.
    launch = [
        "sglang-typo-xyz",
        "serve",
        "--model-path",
        str(model),
        "--page-size",
        "64",
        "--kv-cache-dtype",
        "fp8_e4m3",
    ]
    out = cli_process("--root", str(root), "exec", "--", *launch, env=NO_STORAGE_ENV)
    assert "cannot run 'sglang-typo-xyz'" in one_line_error(out) and out.returncode == 1
    assert snapshot(root / "ns") == before
    assert audit(root) == []


def fake_installed_sglang(where: Path, version: str) -> dict[str, str]:
    """An environment in which `sglang` is an installed distribution (metadata only)."""
    dist = where / f"sglang-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    return {**NO_STORAGE_ENV, "PYTHONPATH": str(where)}


def test_init_without_sglang_keeps_the_namespace_exec_made_with_it(
    root: Path, model: Path, tmp_path: Path
) -> None:
    launch = [*CMD.split(), "--model-path", str(model)]
    installed = fake_installed_sglang(tmp_path / "site", "0.5.23")
    first = cli_process("--root", str(root), "init", "--json", "--", *launch, env=installed)
    assert first.returncode == 0, first.stderr
    ns = json.loads(first.stdout)["ns_id"]
    fill(root / "ns" / ns, 3)
    # The same server, now prepared where SGLang is not installed (an initContainer).
    out = cli("--root", str(root), "init", "--json", "--", *launch, env=NO_STORAGE_ENV)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert (result["outcome"], result["ns_id"]) == ("unchanged", ns)
    assert "using version 0.5 of the instance's namespace" in out.stderr
    assert len(os.listdir(root / "ns" / ns)) == 3
    assert audit(root) == []


def test_an_undetectable_sglang_version_is_said_once_with_the_fix(root: Path, model: Path) -> None:
    out = init(root, model)
    assert out.returncode == 0, out.stderr
    warnings = [ln for ln in out.stderr.splitlines() if "SGLang version" in ln]
    assert len(warnings) == 1 and "--sglang-version" in warnings[0]
    assert json.loads(next(root.glob("ns/*.json")).read_text())["identity"]["sglang_version"] == (
        "unknown"
    )


@pytest.fixture
def live_server(tmp_path: Path) -> Iterator[Callable[[Path], subprocess.Popen[str]]]:
    """Start stand-in servers (real processes) whose storage dir env names a namespace dir."""
    procs: list[subprocess.Popen[str]] = []

    def start(ns_dir: Path) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"],
            stdin=subprocess.PIPE,
            text=True,
            env={**os.environ, "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(ns_dir)},
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.communicate(timeout=30)  # closing stdin ends it


def test_purging_a_namespace_a_running_server_uses_is_refused(
    root: Path, model: Path, live_server: Callable[[Path], subprocess.Popen[str]]
) -> None:
    a = init_json(root, model)
    a_dir = Path(str(a["storage_dir"]))
    fill(a_dir, 3)
    live_server(a_dir)  # server 1 still runs on it; server 2 comes with the same instance name
    before = snapshot(root)
    out = init(root, model, kv="fp8_e4m3")
    line = one_line_error(out)
    assert out.returncode == 2
    assert "is in use by running process" in line and "--instance" in line
    assert snapshot(root) == before and audit(root) == []
    # The ways out: retain, another instance name, or --force.
    assert init_json(root, model, "--on-change", "retain", kv="fp8_e4m3")["old_action"] == (
        "retained"
    )
    assert init_json(root, model)["ns_id"] == a["ns_id"]  # back on a (retained), still live
    forced = init_json(root, model, "--force", kv="fp8_e4m3")
    assert forced["old_action"] == "purged" and not a_dir.exists()


def test_a_stopped_servers_namespace_is_purged_on_restart(
    root: Path, model: Path, live_server: Callable[[Path], subprocess.Popen[str]]
) -> None:
    a = init_json(root, model)
    a_dir = Path(str(a["storage_dir"]))
    fill(a_dir, 3)
    proc = live_server(a_dir)
    proc.communicate(timeout=30)  # stopped for the restart with a new config
    assert init_json(root, model, kv="fp8_e4m3")["old_action"] == "purged"


def test_the_shell_running_init_is_not_taken_for_a_server(root: Path, model: Path) -> None:
    a = init_json(root, model)
    # `eval "$(cachemgr init --print-env)"` left the old dir exported in the operator's shell.
    launch = " ".join([*CMD.split(), "--model-path", str(model), "--kv-cache-dtype", "fp8_e4m3"])
    script = f"{sys.executable} -m cachemgr --root {root} init --json -- {launch}; exit $?"
    out = subprocess.run(
        ["sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(a["storage_dir"])},
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["old_action"] == "purged"


def test_the_file_storage_path_flag_warns_as_the_extra_config_does(root: Path, model: Path) -> None:
    # SGLang gives --file-storage-path to the backend as file_storage_path when the extra config
    # has none (unified_radix_cache.py); the extra config's own wins.
    launch = [*CMD.split(), "--model-path", str(model), "--file-storage-path", "/srv/flag"]
    out = cli("--root", str(root), "init", "--", *launch, env=NO_STORAGE_ENV)
    assert out.returncode == 0, out.stderr
    assert "--file-storage-path is /srv/flag: SGLang uses it unless" in out.stderr
    extra = ["--hicache-storage-backend-extra-config", '{"file_storage_path": "/srv/extra"}']
    out = cli("--root", str(root), "init", "--", *launch, *extra, env=NO_STORAGE_ENV)
    assert out.returncode == 0, out.stderr
    assert "file_storage_path is /srv/extra: SGLang uses it unless" in out.stderr
    assert "/srv/flag" not in out.stderr


@pytest.mark.parametrize(
    ("text", "ours"),
    [
        ("", True),  # a placeholder: nothing to lose
        (HEADER + "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=/c\n", True),
        ("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR='/c d'\n", True),  # before the header
        ("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=/c", False),  # no final newline
        ("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR='/c'\n", False),  # not as shlex.quote says it
        ("SGLANG_ARGS=--tp\n", False),  # another variable
        ("# my settings\nSGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=/c\n", False),
        (None, False),  # unreadable, too large, not UTF-8
    ],
)
def test_which_env_files_are_inits(text: str | None, ours: bool) -> None:
    assert is_ours(text) is ours


def test_every_engines_variables_in_inits_shape_are_inits() -> None:
    names = [n for e in engines.ENGINES for n in e.server_env_vars]
    assert is_ours("".join(f"{n}=/c\n" for n in names))


def test_a_running_server_is_seen_under_another_name_of_its_root(
    tmp_path: Path, model: Path, live_server: Callable[[Path], subprocess.Popen[str]]
) -> None:
    # One root, two names: its real path and one through a symlinked parent (/data -> /mnt/x).
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    real, alias = tmp_path / "real" / "root", tmp_path / "alias" / "root"
    a = init_json(alias, model)
    live_server(Path(str(a["storage_dir"])))  # the server got the alias's spelling of its dir
    before = snapshot(real)
    out = init(real, model, kv="fp8_e4m3")
    assert out.returncode == 2 and "is in use by running process" in one_line_error(out)
    assert snapshot(real) == before


@pytest.mark.parametrize(
    "where", ["ns/default.bind", "ns/{ns}.json", "ns/{ns}", ".cachemgr/hicache.env", ".trash/e"]
)
def test_an_env_file_among_cachemgrs_own_files_is_refused(
    tmp_path: Path, root: Path, model: Path, where: str
) -> None:
    # Absent when checked, written by init itself next (its binding file, its manifest): the
    # env file then replaced it, and the namespace was bad-manifest for good, exit 0.
    ns = init_json(tmp_path / "elsewhere", model)["ns_id"]  # the launch's namespace
    assert cli("--root", str(root), "config", "--check").returncode == 0
    before = snapshot(root)
    out = init(root, model, "--env-file", str(root / where.format(ns=ns)))
    assert out.returncode == 2 and "cachemgr's own dir" in one_line_error(out)
    assert snapshot(root) == before


def test_a_running_server_given_a_relative_storage_dir_is_seen(root: Path, model: Path) -> None:
    a = init_json(root, model)
    # Started by hand from the root, as `SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=ns/<id>`.
    env = {**os.environ, "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": f"ns/{a['ns_id']}"}
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        text=True,
        env=env,
        cwd=root,
    )
    try:
        before = snapshot(root)
        out = init(root, model, kv="fp8_e4m3")  # run from another dir: this test's
        assert out.returncode == 2 and f"running process {server.pid}" in one_line_error(out)
        assert snapshot(root) == before
    finally:
        server.communicate("", timeout=30)
