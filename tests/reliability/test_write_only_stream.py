"""A write-only stream (a cold cache getting unique prompts) against the real daemon on a
loopback port: the cap and the free-space floor hold, and the oldest pages go first.

Issue 21: every store was learned as the successor of the one before, across requests, so the
stream became one chain whose newest pages, in flight, held all their ancestors: a 2 MB cap
reached 15.6 MB in 25 s, a 20% floor went to 52 KB free (the writer got ENOSPC), and once the
writer stopped the newest pages went first. Bytes on disk are sampled every 25 ms, as
bench/bench_replay.py does (page files counted, times the page size).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cachemgr.fs import reserve
from cachemgr.fs.root import create_root
from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from tests.daemon_helpers import NS_A, page_name, register_namespace, running_daemon, store_page
from tests.polling import wait_for

PAGE = 32 << 10
MB = 1 << 20
SLACK = 1.05  # the bound: max bytes on disk at most 1.05 x the cap


@dataclass
class Sampler:
    """Page bytes in a dir and free bytes on its filesystem, every 25 ms, on a thread."""

    ns_dir: Path
    most: int = 0
    least_free: int = 1 << 62
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def bytes(self) -> int:
        return PAGE * sum(1 for e in os.scandir(self.ns_dir) if e.name.endswith(".bin"))

    def _run(self) -> None:
        while not self._stop.wait(0.025):
            self.most = max(self.most, self.bytes())
            st = os.statvfs(self.ns_dir)
            self.least_free = min(self.least_free, st.f_bavail * st.f_frsize)
            self.samples += 1

    @contextmanager
    def running(self) -> Iterator[Sampler]:
        t = threading.Thread(target=self._run, daemon=True)
        t.start()
        try:
            yield self
        finally:
            self._stop.set()
            t.join()


def write_stream(ns_dir: Path, pages: int, every: float, seconds: float) -> int:
    """Unique prompts of `pages` pages (SGLang's temp file, then rename) every `every` s;
    returns the number of prompts written. A writer held up (a loaded box: the daemon shares
    this process's GIL) catches up at most to 3/4 of its interval, never back to back: prompts
    stored back to back are one request's burst to the daemon, as they would be from SGLang,
    whose tail it rightly evicts first."""
    prompts = int(seconds / every)
    start = time.monotonic()
    for n in range(prompts):
        for p in range(pages):
            store_page(ns_dir, page_name(n * pages + p), PAGE)
        time.sleep(max(every * 0.75, start + (n + 1) * every - time.monotonic()))
    return prompts


def oldest_first(ns_dir: Path, prompts: int, pages: int) -> tuple[int, int]:
    """(prompts entirely deleted that are newer than the oldest prompt left, prompts left)."""
    names = {e.name for e in os.scandir(ns_dir) if e.name.endswith(".bin")}
    left = [
        n for n in range(prompts) if any(page_name(n * pages + p) in names for p in range(pages))
    ]
    gone = [n for n in range(prompts) if n not in set(left)]
    return sum(1 for n in gone if n > min(left)), len(left)


def settings_for(root: Path, **kw: object):  # type: ignore[no-untyped-def]
    return load_settings(root=root, gc_min_age=0, gc_interval=3600, **kw)


@pytest.mark.parametrize(
    ("pages", "every", "cap"),
    [(4, 0.1, 2 * MB), (4, 0.1, 4 * MB), (1, 0.02, 2 * MB), (1, 0.02, 4 * MB)],
    ids=["4-pages-100ms-2MB", "4-pages-100ms-4MB", "50-pages-s-2MB", "50-pages-s-4MB"],
)
def test_a_write_only_stream_holds_the_cap_and_the_oldest_go_first(
    tmp_path: Path, pages: int, every: float, cap: int
) -> None:
    layout = Layout.at(tmp_path / "root")
    create_root(layout)
    d = register_namespace(layout, NS_A, instance="gpu0")
    with running_daemon(settings_for(layout.root, gc_max_bytes=cap)) as dm:
        with Sampler(d).running() as s:
            prompts = write_stream(d, pages, every, seconds=4 * cap / (PAGE * pages / every))
            wait_for(s.bytes, lambda b: b <= cap * 0.95, timeout=30, what="the cap")
        text = dm.get("/metrics").text
    assert s.samples > 100
    assert s.most <= SLACK * cap, f"{s.most / cap:.2f} x the cap"
    newer_gone, left = oldest_first(d, prompts, pages)
    # (A writer paused mid-prompt on a loaded machine splits that prompt in two chains, which
    # may swap with a neighbour: a prompt or two at the boundary. Newest first was all of them.)
    assert left and newer_gone <= 2, f"{newer_gone} prompts newer than the oldest left went"
    assert "cachemgr_gc_protection_overridden_total" in text


def test_a_write_only_stream_holds_the_free_space_floor(small_fs: Path) -> None:
    """A 20% floor on a 64 MiB ext4, most of it taken by something else: the writer never
    gets ENOSPC, and free space never goes much under the floor."""
    layout = Layout.at(small_fs / "root")
    create_root(layout)
    d = register_namespace(layout, NS_A, instance="gpu0")
    st = os.statvfs(small_fs)
    total, floor = st.f_blocks * st.f_frsize, st.f_blocks * st.f_frsize // 5
    budget = 4 * MB  # what the floor leaves the cache
    # ... besides the state DB's room (its -wal grows to WAL_BYTES beside the reserve)
    room = reserve.missing_bytes(layout.state_dir, layout.root)
    with open(small_fs / "ballast", "wb") as f:  # someone else's data on the filesystem
        f.truncate(0)
        f.write(b"\0" * (st.f_bavail * st.f_frsize - floor - budget - room))
    settings = settings_for(layout.root, gc_min_free_percent=20)
    with running_daemon(settings), Sampler(d).running() as s:
        prompts = write_stream(d, 4, 0.1, seconds=3 * budget / (PAGE * 40))
        wait_for(s.bytes, lambda b: b <= budget * 0.95, timeout=30, what="the floor")
    assert total > 0 and s.samples > 100
    assert s.least_free >= floor - (SLACK - 1) * budget, f"{s.least_free} free, floor {floor}"
    newer_gone, left = oldest_first(d, prompts, 4)
    assert left and newer_gone <= 2
