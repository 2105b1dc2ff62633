"""Helpers for the namespace tests: namespaces with real page files, and the CLI as a process."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachemgr.cli.main import main
from cachemgr.layout import Layout
from cachemgr.ns.registry import bind, ensure_namespace
from cachemgr.state.store import Store

PAGE_BYTES = 100


def audit_rows(store: Store, action: str, ns: str) -> list[tuple[str, str, int, int]]:
    """(reason, actor, pages, bytes) of each `action` audit row of namespace `ns`."""
    rows = store.conn.execute(
        "SELECT reason, actor, pages, bytes FROM audit WHERE action = ? AND namespace_id = ?",
        (action, ns),
    )
    return [tuple(r) for r in rows]  # type: ignore[misc]


def ns_id_of(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:16]


def page_name(i: int, model: str = "m") -> str:
    return f"{i:064x}_{model}_0_1.bin"


def make_ns(
    layout: Layout,
    store: Store,
    name: str,
    *,
    pages: int = 3,
    instance: str | None = None,
    kv: str = "bfloat16",
) -> str:
    """A namespace with a manifest and `pages` page files; bound to `instance` if given."""
    digest = hashlib.sha256(name.encode()).hexdigest()[:32]
    ns = digest[:16]
    identity = {"kv_cache_dtype": kv, "page_size": 64, "source": {"served_model_name": name}}
    ensure_namespace(layout, store, ns_id=ns, digest=digest, identity=identity, now=time.time())
    for i in range(pages):
        (layout.ns_dir(ns) / page_name(i, name)).write_bytes(bytes([i % 256]) * PAGE_BYTES)
    if instance is not None:
        with store.transaction():
            bind(layout, store, instance, ns, time.time())
    return ns


def snapshot(top: Path) -> dict[str, bytes]:
    """Every file below `top` with its bytes (symlinks as their target), for before/after."""
    out: dict[str, bytes] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for n in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath, n)
            rel = str(p.relative_to(top))
            out[rel] = os.readlink(p).encode() if p.is_symlink() else p.read_bytes()
    return out


def cli(
    *args: str, stdin: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`cachemgr ARGS` in this process (as the console script runs it), with JSON logs, no TTY.

    In-process keeps the suite fast; tests that need a real process (exec, kill -9) use
    `cli_process`. `env` values of "" unset the variable for the call.
    """
    argv = ["--log-format", "json", *args]
    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    for key, value in (env or {}).items():
        if value:
            os.environ[key] = value
        else:
            os.environ.pop(key, None)
    code = 0
    try:
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            _stdin(io.StringIO(stdin or "")),
        ):
            try:
                main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """The CLI's `main` in this process, as click exits it: its exit code and stderr lines."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    return int(e.value.code or 0), capsys.readouterr().err.splitlines()


@contextlib.contextmanager
def _stdin(replacement: io.StringIO) -> Iterator[None]:
    saved, sys.stdin = sys.stdin, replacement
    try:
        yield
    finally:
        sys.stdin = saved


def cli_process(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`cachemgr ARGS` as a real process with JSON logs and no TTY."""
    return subprocess.run(
        [sys.executable, "-m", "cachemgr", "--log-format", "json", *args],
        capture_output=True,
        text=True,
        input="",
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def one_line_error(out: subprocess.CompletedProcess[str]) -> str:
    """The single `cachemgr: error:` line of a failed run (asserting there is exactly one)."""
    assert out.returncode != 0, out.stdout
    assert "Traceback" not in out.stderr, out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("cachemgr: error: ")]
    assert len(errors) == 1, out.stderr
    return errors[0]
