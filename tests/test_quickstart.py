"""The README's quick start, followed as written: `make run`, `make install`, then
`cachemgr status` and its completion in new login shells with a clean environment.

`make install` writes to /usr/local as the README says, inside a private mount namespace whose
/usr/local/bin and /usr/local/share are empty tmpfs mounts: the host's stay untouched and no
other `cachemgr` can answer. Needs root (a mount namespace; CI runs as root).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO
from tests.polling import wait_for

# /usr/local as on a machine cachemgr was never installed on, for the shells entered below.
FRESH_USR_LOCAL = (
    "mount -t tmpfs tmpfs /usr/local/bin && mount -t tmpfs tmpfs /usr/local/share"
    " && echo ready && exec sleep infinity"
)


def quick_start_commands() -> list[str]:
    """The commands of the README's first code block, comments cut."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"## Quick start.*?```sh\n(.*?)```", readme, re.S)
    assert block is not None, "README has no quick start block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines()]


@pytest.fixture
def fresh_machine() -> Iterator[int]:
    """The pid of a process holding a mount namespace with an empty /usr/local/{bin,share}."""
    if os.geteuid() != 0:
        pytest.skip("a private mount namespace needs root (CI runs as root)")
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", FRESH_USR_LOCAL]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline() == "ready\n"
            yield holder.pid
        finally:
            holder.kill()


class Shells:
    """New login shells (`bash -l`, nothing inherited but HOME and the port) on that machine."""

    def __init__(self, ns_pid: int, home: Path, port: int) -> None:
        self.home = home
        self.port = port
        self.ns_pid = ns_pid
        self.env = ["env", "-i", f"HOME={home}", f"CACHEMGR_PORT={port}"]

    def argv(self, command: str, cwd: Path) -> list[str]:
        # Entering a mount namespace moves to its "/": --wd starts the shell where it is typed.
        enter = ["nsenter", "-t", str(self.ns_pid), "-m", f"--wd={cwd}", "--"]
        return [*enter, *self.env, "bash", "-lc", command]

    def run(self, command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(command, cwd), capture_output=True, text=True, timeout=120)


def _ready(url: str, daemon: subprocess.Popen[str]) -> bool:
    assert daemon.poll() is None, "make run exited"
    try:
        return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


# As the README says: system-wide as root, or for one user below $HOME.
INSTALLS = {"root": "", "user": "PREFIX=$HOME/.local"}


@pytest.mark.root_only
@pytest.mark.parametrize("who", INSTALLS)
def test_readme_quick_start_ends_with_cachemgr_status_in_a_new_shell(
    fresh_machine: int, tmp_path: Path, free_port: int, who: str
) -> None:
    # `make test` is this suite; the others are run as written, each in a new shell.
    assert quick_start_commands() == ["make run", "make test", "make install", "cachemgr status"]
    assert f"{INSTALLS['user']} when not root" in (REPO / "README.md").read_text()
    # A stale venv would be rebuilt by `make install` with another python: set it up first.
    fresh = subprocess.run(["make", "-q", ".venv/.installed"], cwd=REPO, check=False)
    assert fresh.returncode == 0, "the venv is out of date: run `make .venv/.installed` first"
    home = tmp_path / "home"
    home.mkdir()
    if who == "user":  # a new account's ~/.profile: puts ~/.local/bin on the PATH if it exists
        shutil.copy("/etc/skel/.profile", home)
    sh = Shells(fresh_machine, home, free_port)
    log = tmp_path / "make-run.log"
    with (
        open(log, "w") as out,
        subprocess.Popen(
            sh.argv("make run", REPO),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        ) as daemon,
    ):
        try:
            url = f"http://127.0.0.1:{free_port}"
            wait_for(lambda: _ready(url, daemon), timeout=60, what="the daemon of `make run`")
            installed = sh.run(f"make install {INSTALLS[who]}", cwd=REPO)
            assert installed.returncode == 0, installed.stderr
            status = sh.run("cachemgr status", cwd=home)
            assert status.returncode == 0, status.stderr
            # The first line names the daemon's root as the source (a fresh root: no namespaces).
            first = status.stdout.splitlines()[0]
            want = f"no namespaces under {home}/.cache/cachemgr (from daemon)"
            assert first == want, status.stdout
            prefix = "/usr/local" if who == "root" else "$HOME/.local"
            assert_bash_completes(sh, f"{prefix}/share/bash-completion/completions/cachemgr")
            assert sh.run(f"make uninstall {INSTALLS[who]}", cwd=REPO).returncode == 0
            assert sh.run("command -v cachemgr", cwd=home).returncode == 1
        finally:
            os.killpg(daemon.pid, signal.SIGINT)  # Ctrl+C in the terminal of `make run`
            daemon.wait(timeout=60)
    assert "Traceback" not in log.read_text()


def assert_bash_completes(sh: Shells, script: str) -> None:
    """The completion `make install` wrote completes a subcommand, as bash would ask it."""
    complete = (
        f"source {script} && COMP_WORDS=(cachemgr sta) COMP_CWORD=1"
        ' && _cachemgr_completion cachemgr && printf "%s\\n" "${COMPREPLY[@]}"'
    )
    done = sh.run(complete, cwd=sh.home)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["status"]


@pytest.mark.parametrize(
    ("shell", "marker"),
    [
        ("bash_source", "complete -o nosort -F _cachemgr_completion cachemgr"),
        ("zsh_source", "#compdef cachemgr"),
        ("fish_source", "complete --no-files --command cachemgr"),
    ],
)
def test_completion_script_is_produced_for_each_documented_shell(shell: str, marker: str) -> None:
    readme = (REPO / "README.md").read_text()
    assert f"_CACHEMGR_COMPLETE={shell} cachemgr" in readme
    out = subprocess.run(
        [str(REPO / ".venv/bin/cachemgr")],
        env={**os.environ, "_CACHEMGR_COMPLETE": shell},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert marker in out.stdout
