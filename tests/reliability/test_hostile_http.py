"""Hostile HTTP against the real daemon: huge bodies, ambiguous or malformed requests, and floods
of GC and purge requests that must neither buffer, delete, nor starve /healthz and /metrics."""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from cachemgr.daemon.httpguard import MAX_BODY_BYTES
from cachemgr.fs.locks import root_lock
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from tests.daemon_helpers import (
    NS_A,
    NS_B,
    page_name,
    register_namespace,
    running_daemon,
    store_page,
    wait_for,
)
from tests.test_server import metric

GIB = 1 << 30
TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROBLEM = "application/problem+json"
PROMPT = 1.0  # seconds: /healthz and /metrics answer in ms; a GC they queue behind takes 10+ s


@contextmanager
def daemon_process(layout: Layout, port: int, **env: str) -> Iterator[tuple[int, str]]:
    """`cachemgr serve` as its own process (its RSS is its own); (pid, base url) once ready."""
    full = {**os.environ, "CACHEMGR_LOG_FORMAT": "json", **env}
    argv = [sys.executable, "-m", "cachemgr", "--root", str(layout.root), "serve"]
    with subprocess.Popen(
        [*argv, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=full
    ) as proc:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: _ready(url, proc), bool, timeout=30)
            yield proc.pid, url
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                _, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
    assert b"Traceback" not in err, err.decode(errors="replace")


def _ready(url: str, proc: subprocess.Popen[bytes]) -> bool:
    assert proc.poll() is None, "the daemon exited"
    try:
        return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak) of a process, in KiB."""
    text = Path(f"/proc/{pid}/status").read_text()
    return {k: int(v) for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", text, re.M)}


def stream_body(port: int, path: str, headers: str, size: int, chunked: bool) -> tuple[int, int]:
    """POST a `size`-byte body in 64 KiB chunks, stopping as soon as the server answers (or
    drops the connection); (status, body bytes sent by then)."""
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{headers}"
    piece = b"x" * (64 << 10)
    frame = b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"{head}{framing}\r\n\r\n".encode())
        try:
            while sent < size and not select.select([sock], [], [], 0)[0]:
                sock.sendall(frame)
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it answered and closed; the answer is in our receive buffer
        answer = b""
        while b"\r\n" not in answer:
            more = sock.recv(4096)
            assert more, f"closed without an answer after {sent} bytes"
            answer += more
    return int(answer.split()[1]), sent


def test_huge_bodies_are_refused_before_they_are_read(tmp_path: Path, free_port: int) -> None:
    """1 GiB bodies, with and without a token, declared or chunked: the daemon answers 401 or
    413 after at most the cap, and its peak RSS stays flat (it was +2 GiB per body)."""
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    register_namespace(layout, NS_A)
    with daemon_process(layout, free_port, CACHEMGR_TOKEN=TOKEN) as (pid, url):
        warm = httpx.post(f"{url}/v1/gc", params={"dry_run": "true"}, headers=AUTH, timeout=30)
        assert warm.status_code == 200
        before = memory_kib(pid)
        for path in ("/v1/gc", "/purge", f"/v1/namespaces/{NS_A}/purge"):
            for chunked in (False, True):
                no_token = stream_body(free_port, path, "", GIB, chunked)
                assert no_token[0] == 401, (path, chunked, no_token)
                with_token = stream_body(
                    free_port, path, f"Authorization: Bearer {TOKEN}\r\n", GIB, chunked
                )
                assert with_token[0] == 413, (path, chunked, with_token)
                # the kernel's socket buffers take a few MiB; the daemon took at most the cap
                assert max(no_token[1], with_token[1]) < 64 << 20
        after = memory_kib(pid)
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    grew = (after["VmHWM"] - before["VmRSS"]) >> 10
    print(f"daemon RSS {before['VmRSS'] >> 10} MiB before, peak {after['VmHWM'] >> 10} MiB after")
    assert grew < 32, f"the daemon's peak RSS grew by {grew} MiB over 12 refused 1 GiB bodies"


def test_a_body_up_to_the_cap_is_read_and_one_byte_more_is_413(tmp_path: Path) -> None:
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    register_namespace(layout, NS_A)
    with running_daemon(load_settings(root=layout.root)) as dm:
        body = b'{"dry_run": true, "all": true}'
        padded = body + b" " * (MAX_BODY_BYTES - len(body))
        ok = dm.post("/v1/purge", content=padded, headers={"Content-Type": "application/json"})
        assert ok.status_code == 200 and ok.json()["dry_run"] is True
        big = dm.post(
            "/v1/purge", content=padded + b" ", headers={"Content-Type": "application/json"}
        )
        assert big.status_code == 413 and big.headers["content-type"] == PROBLEM
        assert big.json()["status"] == 413 and str(MAX_BODY_BYTES) in big.json()["detail"]
        chunks = iter([padded, b" "])  # no Content-Length: counted as it arrives
        big = dm.post("/v1/purge", content=chunks, headers={"Content-Type": "application/json"})
        assert big.status_code == 413
        assert NS_A in dm.namespaces()


def test_401_comes_before_422(tmp_path: Path) -> None:
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    with running_daemon(load_settings(root=layout.root, token=TOKEN)) as dm:
        for route in ("/v1/gc", "/v1/purge", f"/v1/namespaces/{NS_A}/purge"):
            for content in (b"[not json", b'{"bogus": 1}', b"null"):
                r = dm.post(
                    route,
                    content=content,
                    headers={"Content-Type": "application/json"},
                    params=[("dry_run", "1"), ("dry_run", "0")],
                )
                assert r.status_code == 401 and r.headers["content-type"] == PROBLEM, route
                assert r.headers["www-authenticate"] == "Bearer"


def _malformed(route: str) -> list[dict[str, Any]]:
    """Requests that must be a 422: each would run a real purge or GC if read loosely."""
    dupes = [
        {"params": [("dry_run", "true"), ("dry_run", "false")]},
        {"params": [("dry_run", "true"), ("dry_run", "true")]},
    ]
    bodies = [
        b"null",
        b"[]",
        b'[{"dry_run": true}]',
        b'"dry_run"',
        b"1",
        b"true",
        b'{"dry_run": null}',
        b'{"dry_run": true, "bogus": 1}',
        b'{"dry_run": "true"}',
    ]
    cases = dupes + [{"content": b} for b in bodies]
    cases.append({"params": {"dryrun": "true"}})  # a typo: not silently a real run
    per_namespace = "/namespaces/" in route
    if not per_namespace:
        cases.append({"params": {"dry_run": "true"}, "content": b'{"dry_run": false}'})
        cases.append({"params": {"dry_run": "false"}, "content": b'{"dry_run": true}'})
    else:
        cases.append({"params": {"dry_run": "true"}})  # this route takes no query: not ignored
    if not per_namespace and route != "/v1/gc":
        cases += [
            {"params": [("namespace", NS_A), ("namespace", NS_B)]},
            {"params": [("all", "false"), ("all", "true")]},
            {"content": b'{"namespace": null}'},
            {"content": b'{"namespace": null, "instance": null}'},
            {"params": {"namespace": NS_B}, "content": f'{{"namespace": "{NS_A}"}}'.encode()},
        ]
    return cases


def _audit_rows(layout: Layout) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(f"file:{layout.db_path}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT * FROM audit ORDER BY id").fetchall()
    finally:
        conn.close()


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_malformed_requests_are_422_and_delete_nothing(tmp_path: Path) -> None:
    """Duplicate or contradictory parameters, null/array/string bodies, nulls, unknown fields
    and typos: each a 422 problem, and no file, trash entry or audit row changes."""
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    ns = register_namespace(layout, NS_A, instance="gpu0")
    for i in range(5):
        store_page(ns, page_name(i))
    settings = load_settings(root=layout.root, gc_interval=3600, gc_min_age=0)
    with running_daemon(settings) as dm:
        wait_for(
            lambda: metric(dm.get("/metrics").text, "cachemgr_gc_runs_total", result="ok"),
            lambda n: (n or 0) >= 1,
        )
        entry = layout.trash / f"{NS_B}.old"  # what a real GC run deletes
        entry.mkdir()
        for i in range(3):
            store_page(entry, page_name(i))
        before = (_tree(layout.root), _audit_rows(layout))
        json_type = {"Content-Type": "application/json"}
        for route in ("/v1/gc", "/purge", "/v1/purge", f"/v1/namespaces/{NS_A}/purge"):
            for case in _malformed(route):
                r = dm.post(route, headers=json_type, **case)
                # 400: a parameter unknown or given twice; 422: a value of the wrong type
                assert r.status_code in (400, 422), (route, case, r.status_code, r.text)
                assert r.headers["content-type"] == PROBLEM, (route, case)
                assert (_tree(layout.root), _audit_rows(layout)) == before, (route, case)
            chosen = {"all": True} if route in ("/purge", "/v1/purge") else {}
            dry = dm.post(
                route,
                params={"dry_run": "true"} if "namespaces" not in route else None,
                json={"dry_run": True, **chosen},
            )
            assert dry.status_code == 200 and dry.json()["dry_run"] is True, dry.text
        assert (_tree(layout.root), _audit_rows(layout)) == before
        real = dm.post("/v1/gc", json={"dry_run": False})  # the check above can see a deletion
        assert real.status_code == 200 and real.json()["by_reason"]["trash"]["files"] == 3
        assert not entry.exists()


def _timed_get(client: httpx.Client, path: str) -> float:
    t0 = time.monotonic()
    assert client.get(path).status_code == 200
    return time.monotonic() - t0


def _poll_while(client: httpx.Client, busy: Any, polls: int = 3) -> float:
    """The slowest /healthz or /metrics answer over `polls` rounds, each started while `busy()`
    (or over fewer, once one was already too slow)."""
    slowest = 0.0
    for done in range(polls):
        assert busy(), f"the slow work ended after {done} polls; make it slower"
        slowest = max(slowest, _timed_get(client, "/healthz"), _timed_get(client, "/metrics"))
        if slowest >= PROMPT:
            break
        time.sleep(0.1)
    return slowest


def test_gc_requests_during_a_gc_join_it_and_leave_health_free(
    tmp_path: Path, free_port: int
) -> None:
    """A paced GC deleting 3000 files (~5 s), 50 real and 50 dry-run GC requests on top: the
    real ones get the running run's result (one run), the dry runs share one dry run, and
    /healthz and /metrics answer promptly throughout (they took 34.6 s)."""
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    register_namespace(layout, NS_A, instance="gpu0")
    env = {"CACHEMGR_GC_INTERVAL": "1h", "CACHEMGR_GC_DELETE_RATE": "600"}
    with (
        daemon_process(layout, free_port, **env) as (_, url),
        httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_connections=200)) as client,
    ):

        def runs() -> float | None:
            return metric(client.get("/metrics").text, "cachemgr_gc_runs_total", result="ok")

        ok_before = wait_for(runs, lambda n: (n or 0) >= 1)  # the start-up run is over
        entry = layout.trash / f"{NS_B}.slow"
        entry.mkdir()
        for i in range(3000):
            (entry / page_name(i)).write_bytes(b"x")
        with ThreadPoolExecutor(101) as pool:
            first = pool.submit(client.post, "/v1/gc")
            wait_for(lambda: len(os.listdir(entry)), lambda n: n < 3000)  # it is deleting
            real = [pool.submit(client.post, "/v1/gc") for _ in range(50)]
            dry = [
                pool.submit(client.post, "/v1/gc", params={"dry_run": "true"}) for _ in range(50)
            ]
            slowest = _poll_while(client, lambda: entry.exists() and not first.done())
            answers = [f.result() for f in [first, *real, *dry]]
        assert slowest < PROMPT, f"/healthz or /metrics took {slowest:.2f}s during GC"
        assert all(a.status_code == 200 for a in answers), {a.status_code for a in answers}
        got = [a.json() for a in answers]
        assert len({g["started_at"] for g in got[:51]}) == 1, "a request ran a GC of its own"
        assert got[0]["by_reason"]["trash"]["files"] == 3000
        assert all(g["dry_run"] for g in got[51:]) and len({g["started_at"] for g in got[51:]}) == 1
        assert runs() == ok_before + 1


def test_purges_waiting_on_the_root_lock_leave_health_free(tmp_path: Path, free_port: int) -> None:
    """Another process holds the root lock: 50 purges and 20 dry runs wait without pinning a
    worker thread each, then the first purges the namespace and the rest find it gone."""
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    ns = register_namespace(layout, NS_A)
    for i in range(10):
        store_page(ns, page_name(i))
    with (
        daemon_process(layout, free_port, CACHEMGR_GC_INTERVAL="1h") as (_, url),
        httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_connections=200)) as client,
    ):
        wait_for(lambda: client.get(f"/v1/namespaces/{NS_A}").json()["pages"], lambda n: n == 10)
        audited = len(_audit_rows(layout))
        futures: list[Future[httpx.Response]] = []
        with ThreadPoolExecutor(70) as pool, root_lock(layout):
            futures += [
                pool.submit(client.post, "/v1/purge", json={"namespace": NS_A}) for _ in range(50)
            ]
            dry = {"dry_run": "true", "all": "true"}
            futures += [pool.submit(client.post, "/purge", params=dry) for _ in range(20)]
            started = time.monotonic()
            slowest = _poll_while(client, lambda: time.monotonic() - started < 2.0)
            assert slowest < PROMPT, f"/healthz or /metrics took {slowest:.2f}s behind purges"
            assert not any(f.done() for f in futures[:50]), "a purge ran past the root lock"
        answers = [f.result() for f in futures]
    codes = [a.status_code for a in answers[:50]]
    assert codes.count(200) == 1 and codes.count(404) == 49, codes
    assert all(a.status_code == 200 and a.json()["dry_run"] for a in answers[50:])
    purges = [r for r in _audit_rows(layout)[audited:] if r[2] == "purge"]
    assert len(purges) == 1, purges
