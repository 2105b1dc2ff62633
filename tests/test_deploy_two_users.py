"""The two-user systemd deploy of docs/deploy.md, end to end: the daemon as one uid (`cachemgr`),
SGLang's real HiCacheFile as another in the daemon's group with UMask=0002 (the drop-in), the
root made by `install -d -o cachemgr -g cachemgr -m 2775`. `init` works before or after the
daemon started, and the daemon's GC holds the cap on the pages SGLang's user wrote."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import SGLANG_ENV, SglangDriver, start_driver
from tests.gc_helpers import page_bytes
from tests.polling import wait_for
from tests.test_identity import make_model
from tests.users import User, cli_as, daemon_as, needs_root, shared_dir, shared_root

pytestmark = [pytest.mark.sglang, needs_root]
CMGR = User(uid=23001, gids=(23001,))  # `useradd --system cachemgr`, UMask=0002 in its unit
SGLANG = User(uid=23002, gids=(23002, 23001))  # SupplementaryGroups=cachemgr, UMask=0002
PAGE_BYTES = 512 * 2  # elems=512 in bfloat16
CAP = 20 * PAGE_BYTES
LAUNCH = "sglang serve --enable-hierarchical-cache --hicache-storage-backend file --page-size 64"


@pytest.fixture
def writer(monkeypatch: pytest.MonkeyPatch) -> Iterator[SglangDriver]:
    """SGLang's HiCacheFile in a driver of its own, as SGLang's user (with a copy of root's
    built torch extensions, which it would otherwise rebuild and lock in root's home)."""
    with shared_dir("cachemgr-sglang-home-") as home:
        built = Path(
            os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache/torch_extensions")
        )
        ext = home / "torch_extensions"
        if built.is_dir():
            shutil.copytree(built, ext)
        subprocess.run(["chown", "-R", f"{SGLANG.uid}:{SGLANG.gids[0]}", str(home)], check=True)
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
        monkeypatch.setenv("HOME", str(home))
        yield from _writer()


def _writer() -> Iterator[SglangDriver]:
    proc = start_driver(SGLANG_ENV, "sglang-env.sh", "sglang_driver.py", "SGLANG_", SGLANG)
    driver = SglangDriver(proc)
    yield driver
    driver.close()


# cachemgr.service's settings (the cap from its config; quicker cycles for the test).
DAEMON_ENV = {
    "CACHEMGR_GC_MAX_BYTES": str(CAP),
    "CACHEMGR_GC_INTERVAL": "0.5",
    "CACHEMGR_GC_MIN_AGE": "0s",
}


def init(root: Path, model: Path) -> Path:
    """The drop-in's ExecStartPre: `cachemgr init` as SGLang's user; the storage dir it gives."""
    launch = [*LAUNCH.split(), "--model-path", str(model)]
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": ""}
    out = cli_as(SGLANG, "--root", str(root), "init", "--json", "--", *launch, env=env)
    assert out.returncode == 0, out.stderr
    return Path(json.loads(out.stdout)["storage_dir"])


@pytest.mark.parametrize("order", ["daemon-first", "init-first"])
def test_two_user_deploy_holds_the_cap(order: str, writer: SglangDriver, free_port: int) -> None:
    with shared_dir("cachemgr-two-users-") as top:
        model = make_model(top / "model")
        root = shared_root(top, owner=CMGR.uid, group=CMGR.gids[0])
        storage = init(root, model) if order == "init-first" else None
        with daemon_as(CMGR, root, free_port, DAEMON_ENV) as url:
            storage = storage or init(root, model)
            ns_dir = storage
            st = ns_dir.stat()
            # The deploy's modes: the group's write and the setgid root's group, inherited.
            assert st.st_gid == CMGR.gids[0]
            assert stat.S_IMODE(st.st_mode) == 0o2775
            handle = writer.open(ns_dir, model=str(model))
            for s in range(6):  # 6 prompts of 10 pages: 3x the cap
                stored = writer.write(handle, [[s, 640]])["stored"]
                assert stored == 10
            held = "GC to hold the cap on SGLang's pages"
            wait_for(lambda: page_bytes(ns_dir), lambda n: n <= CAP, timeout=60, what=held)
            metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert 'cachemgr_gc_runs_total{result="error"} 0.0' in metrics
