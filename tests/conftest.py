"""Fixtures shared by the suite: real temp roots, free ports, and the engines' own cache tiers
(SGLang's HiCacheFile, vLLM's file-system tier), each driven in its own environment."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.settings import Settings, load_settings
from cachemgr.state.store import Store

if TYPE_CHECKING:
    from tests.users import User

REPO = Path(__file__).resolve().parent.parent
SGLANG_ENV = Path(os.environ.get("CACHEMGR_SGLANG_ENV", REPO / ".sglang-env"))
VLLM_ENV = Path(os.environ.get("CACHEMGR_VLLM_ENV", REPO / ".vllm-env"))

# How full the host's disk is is not a test's business: with the default 5% floors, a CI box
# whose /tmp has 7% free saw `disk-low` in every doctor report and its daemons' floor pass
# delete test pages while a neighbour wrote. So the floors are off in the suite (before any
# Settings is read; subprocesses inherit it), and the tests of the floors set their own
# percent on a filesystem they size (reliability's `small_fs`).
HOST_NEUTRAL = {"CACHEMGR_GC_MIN_FREE_PERCENT": "0", "CACHEMGR_GC_MIN_FREE_INODES_PERCENT": "0"}
for _name, _value in HOST_NEUTRAL.items():
    os.environ.setdefault(_name, _value)


@pytest.fixture
def no_caller_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CACHEMGR_* of the caller's shell reaches the test, but the suite's HOST_NEUTRAL: a
    daemon a test starts must not take the host's free space for a full disk."""
    for name in [k for k in os.environ if k.startswith("CACHEMGR_") and k not in HOST_NEUTRAL]:
        monkeypatch.delenv(name)


# Files whose claims are about time: a bound on a wait, a rate the daemon keeps up with, a
# kill that must land mid-run, what inotify's timing lets the chain model learn. They run
# `serial` (see pytest_addoption): alone, as the suite ran before xdist, not beside the
# parallel workers' load.
SERIAL_FILES = {
    "tests/reliability/test_exclusive_lock.py",
    "tests/reliability/test_fd_flood.py",
    "tests/reliability/test_foreign_lock.py",
    "tests/reliability/test_full_disk.py",
    "tests/reliability/test_hostile_http.py",
    "tests/reliability/test_inode_floor.py",
    "tests/reliability/test_rules.py",
    "tests/reliability/test_stalled_readers.py",
    "tests/reliability/test_write_only_stream.py",
    "tests/test_bench_replay.py",
    "tests/test_connections.py",
    "tests/test_daemon_chains.py",
    "tests/test_daemon_signals.py",
    "tests/test_fleet_procs.py",
    "tests/test_fleet_sglang.py",
    "tests/test_gc_keeps_up.py",
    # Drives SGLang's real writes, whose file times teach the chain model each request's burst
    # (BURST_GAP): beside four workers on two cores, one request's stores came apart and a
    # session's head went before its tail (CI, once).
    "tests/test_gc_sglang.py",
    "tests/test_model_snapshot.py",
    "tests/test_vllm_chains.py",
    "tests/test_vllm_gc.py",
    # Counts a new namespace's stores as writes only if the watcher keeps up with them (else
    # they are found by a listing): under four workers' load it did not, once in four passes.
    "tests/test_vllm_index.py",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--serial",
        choices=("include", "exclude", "only"),
        default="include",
        help="the `serial` tests (timing claims): run them too (default), leave them out (make "
        "test's parallel pass), or run only them (its second pass, in one process)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the SERIAL_FILES' tests `serial` and selects by --serial. (Under `make test`'s
    xdist, --dist loadfile, each test file runs on one worker, in its own order, its module
    fixtures set up once.)"""
    gone = sorted(f for f in SERIAL_FILES if not (REPO / f).is_file())
    if gone:  # a renamed file would silently run beside the workers' load
        raise pytest.UsageError(f"SERIAL_FILES names files that are not there: {gone}")
    for item in items:
        if item.nodeid.split("::")[0] in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)
    mode = config.getoption("serial")
    if mode == "include":
        return
    keep = [i for i in items if (i.get_closest_marker("serial") is not None) == (mode == "only")]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An empty cache root in a fresh temp dir."""
    return tmp_path / "root"


@pytest.fixture
def settings(root: Path) -> Settings:
    return load_settings(root=root, log_format="json")


@pytest.fixture
def layout(root: Path) -> Layout:
    lay = Layout.at(root)
    create_root(lay)
    return lay


@pytest.fixture
def store(layout: Layout) -> Iterator[Store]:
    """The root's state DB, closed after the test."""
    s = Store.open(layout.db_path)
    yield s
    s.close()


# A worker told to stop may take a moment to notice (a batch interval, a poll timeout).
_THREAD_GRACE = 5.0


@pytest.fixture(autouse=True)
def no_leaked_threads_or_fds() -> Iterator[None]:
    """Fail a test that leaves a thread running or a file descriptor open.

    Session- and module-scoped fixtures (the SGLang driver's pipes, a shared daemon) are set
    up before this function-scoped fixture and torn down after it, so they are in `before`.
    """
    threads_before = set(threading.enumerate())
    fds_before = _open_fds()
    yield
    deadline = time.monotonic() + _THREAD_GRACE
    for t in set(threading.enumerate()) - threads_before:
        t.join(max(0.0, deadline - time.monotonic()))
    threads = [t.name for t in set(threading.enumerate()) - threads_before]
    fds = _new_fds(fds_before)
    if fds:
        gc.collect()  # an fd held only by unreachable objects is closed by the collector
        fds = _new_fds(fds_before)
    # A shared daemon's threads open files for a moment (a manifest read on an inotify event
    # the test's last request caused): such an fd is gone within the grace, a leak is not.
    fd_deadline = time.monotonic() + 1.0
    while fds and time.monotonic() < fd_deadline:
        time.sleep(0.02)
        fds = _new_fds(fds_before)
    assert not threads, f"threads left running: {threads}"
    assert not fds, f"file descriptors left open: {fds}"


def _open_fds() -> dict[int, str]:
    """fd -> what it points at, for this process."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except FileNotFoundError:  # the fd listdir itself used, closed by now
            continue
    return out


def _new_fds(before: dict[int, str]) -> dict[int, str]:
    """fds opened since `before`, but for one kind that is not a leak: SQLite does not close
    a connection's fd while another connection of the process holds a lock on that file (it
    would drop their POSIX locks); it parks the fd and closes it when the locks go. So a
    database a longer-lived fixture keeps open (a module's daemon) may show one more fd."""
    held = set(before.values())
    return {
        fd: target
        for fd, target in _open_fds().items()
        if before.get(fd) != target and not (target.endswith(".db") and target in held)
    }


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class JsonLineDriver:
    """A client of a driver script (tests/*_driver.py) that runs an engine's own classes in the
    engine's environment and answers one JSON line per request."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        assert json.loads(self._readline()) == {"ready": True}

    def _readline(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.proc.args} exited with {self.proc.wait()}")
        return line

    def call(self, op: str, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **req}) + "\n")
        self.proc.stdin.flush()
        resp: dict[str, Any] = json.loads(self._readline())
        if "error" in resp:
            raise RuntimeError(f"driver {op}: {resp['error']}")
        return resp

    def close(self) -> None:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


def start_driver(
    env: Path,
    builder: str,
    script: str,
    env_prefix: str | tuple[str, ...],
    user: User | None = None,
    extra_env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    """Run tests/<script> with `env`'s python, without the variables named `env_prefix…` (the
    engine's own; `()` keeps all), with `extra_env` (as `user`, if given: the deploy tests)."""
    python = env / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{env} is missing: run scripts/{builder} (make test does)")
    environ = {k: v for k, v in os.environ.items() if not k.startswith(env_prefix)}
    return subprocess.Popen(
        [str(python), str(REPO / "tests" / script)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=sys.stderr,
        text=True,
        env={**environ, **(extra_env or {})},
        preexec_fn=user.become if user is not None else None,
    )


class SglangDriver(JsonLineDriver):
    """tests/sglang_driver.py running SGLang's HiCacheFile in .sglang-env."""

    def open(self, storage_dir: Path, model: str = "Qwen/Qwen3-8B", **cfg: Any) -> int:
        """A HiCacheFile on `storage_dir`, as one TP rank of a server would create it."""
        return int(self.call("open", dir=str(storage_dir), model=model, **cfg)["handle"])

    def write(self, handle: int, tokens: list[list[int]], **kw: Any) -> dict[str, Any]:
        return self.call("write", handle=handle, tokens=tokens, **_page_defaults(kw))

    def read(self, handle: int, tokens: list[list[int]], **kw: Any) -> dict[str, Any]:
        return self.call("read", handle=handle, tokens=tokens, **_page_defaults(kw))


def _page_defaults(kw: dict[str, Any]) -> dict[str, Any]:
    return {"page_size": 64, "dtype": "bfloat16", "elems": 512, "tag": "A", **kw}


@pytest.fixture(scope="session")
def sglang() -> Iterator[SglangDriver]:
    """SGLang's own file backend in a subprocess; the env is built by scripts/sglang-env.sh."""
    driver = SglangDriver(start_driver(SGLANG_ENV, "sglang-env.sh", "sglang_driver.py", "SGLANG_"))
    yield driver
    driver.close()


class VllmDriver(JsonLineDriver):
    """tests/vllm_driver.py running vLLM's FileSystemTierManager in .vllm-env; its docstring
    lists the requests (open, store, lookup, load, close, unlink, files)."""

    def open(self, root_dir: Path, model: str = "Qwen/Qwen3-0.6B", **cfg: Any) -> dict[str, Any]:
        """A tier on `root_dir` (vLLM's `secondary_tiers[fs].root_dir`), as a server builds it."""
        return self.call("open", root_dir=str(root_dir), model=model, **cfg)


@pytest.fixture(scope="session")
def vllm() -> Iterator[VllmDriver]:
    """vLLM's own file-system KV tier in a subprocess; the env is built by scripts/vllm-env.sh.
    Its import takes 10-20 s, so one process serves the session."""
    driver = VllmDriver(start_driver(VLLM_ENV, "vllm-env.sh", "vllm_driver.py", "VLLM_"))
    yield driver
    driver.close()


class ScriptRunner(JsonLineDriver):
    """tests/script_runner.py in an engine's env: the tests' scripts (the engine's own parser
    fed argvs, the flag table generator) run there one after another, each as `python -c` or
    `python PATH` would run it; the engine is imported once, not once per script."""

    def run(
        self,
        script: str = "",
        *,
        path: Path | None = None,
        stdin: str = "",
        argv: list[str] | None = None,
    ) -> str:
        """What the script (or the file at `path`) printed; a script that fails raises."""
        where = {"path": str(path)} if path is not None else {"script": script}
        return str(self.call("run", stdin=stdin, argv=argv or [], **where)["stdout"])


@pytest.fixture(scope="session")
def sglang_scripts() -> Iterator[ScriptRunner]:
    """SGLang's env running the tests' scripts; its import is paid once per session."""
    runner = ScriptRunner(start_driver(SGLANG_ENV, "sglang-env.sh", "script_runner.py", ()))
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def vllm_scripts() -> Iterator[ScriptRunner]:
    """vLLM's env running the tests' scripts, on the CPU platform as the parser tests always
    ran it; its 10-20 s import is paid once per session."""
    proc = start_driver(
        VLLM_ENV, "vllm-env.sh", "script_runner.py", (), extra_env={"VLLM_TARGET_DEVICE": "cpu"}
    )
    runner = ScriptRunner(proc)
    yield runner
    runner.close()


@pytest.fixture
def fake_vllm(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH has a `vllm` that prints the argv it got, as JSON (what
    `cachemgr exec` ran it with)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "vllm"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    return {"PATH": f"{bindir}:{os.environ['PATH']}"}
