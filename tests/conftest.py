"""Fixtures shared by the suite: real temp roots, free ports, and SGLang's own file backend."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cachemgr.layout import Layout
from cachemgr.settings import Settings, load_settings

REPO = Path(__file__).resolve().parent.parent
SGLANG_ENV = Path(os.environ.get("CACHEMGR_SGLANG_ENV", REPO / ".sglang-env"))


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
    lay.ensure()
    return lay


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SglangDriver:
    """A client of tests/sglang_driver.py running SGLang's HiCacheFile in .sglang-env."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        assert json.loads(self._readline()) == {"ready": True}

    def _readline(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"sglang driver exited with {self.proc.wait()}")
        return line

    def call(self, op: str, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **req}) + "\n")
        self.proc.stdin.flush()
        resp: dict[str, Any] = json.loads(self._readline())
        if "error" in resp:
            raise RuntimeError(f"sglang driver: {resp['error']}")
        return resp

    def open(self, storage_dir: Path, model: str = "Qwen/Qwen3-8B", **cfg: Any) -> int:
        """A HiCacheFile on `storage_dir`, as one TP rank of a server would create it."""
        return int(self.call("open", dir=str(storage_dir), model=model, **cfg)["handle"])

    def write(self, handle: int, tokens: list[list[int]], **kw: Any) -> dict[str, Any]:
        return self.call("write", handle=handle, tokens=tokens, **_page_defaults(kw))

    def read(self, handle: int, tokens: list[list[int]], **kw: Any) -> dict[str, Any]:
        return self.call("read", handle=handle, tokens=tokens, **_page_defaults(kw))

    def close(self) -> None:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


def _page_defaults(kw: dict[str, Any]) -> dict[str, Any]:
    return {"page_size": 64, "dtype": "bfloat16", "elems": 512, "tag": "A", **kw}


@pytest.fixture(scope="session")
def sglang() -> Iterator[SglangDriver]:
    """SGLang's own file backend in a subprocess; the env is built by scripts/sglang-env.sh."""
    python = SGLANG_ENV / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{SGLANG_ENV} is missing: run scripts/sglang-env.sh (make test does)")
    proc = subprocess.Popen(
        [str(python), str(REPO / "tests" / "sglang_driver.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=sys.stderr,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")},
    )
    driver = SglangDriver(proc)
    yield driver
    driver.close()
