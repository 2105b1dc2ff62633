"""The threads cachemgr's C extensions start (a scan's stat threads, the unlinkers) run
cachemgr.fs.NICE nicer than the thread that called them, and that thread keeps its own
priority: on a busy box they give way to the daemon's HTTP thread and to the engine.

Each case runs its call on a thread made a little nicer first (it may raise its own niceness;
it could not lower it again), so a helper set to NICE outright shows as a different number
from one set NICE nicer than its starter.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cachemgr.fs import NICE
from cachemgr.fs.deletion import delete_files
from cachemgr.fs.dirscan import scan_usage
from cachemgr.layout import Layout
from cachemgr.sglang.hicache import HICACHE_FILE
from cachemgr.vllm.fstier import VLLM_FS_TIER
from tests.nsfixtures import page_name
from tests.vllmtrees import write_blocks, write_folder

NS = "0123456789abcdef"
PAGES = 20_000  # enough for a scan to start its stat threads and the unlinkers to take a while
RAISED = 3  # how much nicer the calling thread makes itself first


def _nice(tid: int) -> int | None:
    """The niceness of task `tid` of this process (None: it has exited)."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[16])  # field 19 of proc(5), counted after the command's ")"


def _tasks() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _helpers_seen(
    call: Callable[[], object], niced: Callable[[int], int], until: float
) -> tuple[set[int], int, int]:
    """Run `call` again and again on a thread made RAISED nicer, until a thread it started is
    seen at niced(that thread's niceness) or `until` (monotonic) passes: (the niceness values
    its threads were seen at, the caller's niceness before, after)."""
    known = _tasks()
    seen: set[int] = set()
    caller: list[int] = []

    def run() -> None:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, os.getpriority(os.PRIO_PROCESS, me) + RAISED)
        caller.append(os.getpriority(os.PRIO_PROCESS, me))
        while niced(caller[0]) not in seen and time.monotonic() < until:
            call()
        caller.append(os.getpriority(os.PRIO_PROCESS, me))

    worker = threading.Thread(target=run)
    worker.start()
    known.add(worker.native_id or 0)
    while worker.is_alive():
        for tid in _tasks() - known:
            nice = _nice(tid)
            if nice is not None:
                seen.add(nice)
        time.sleep(0.0002)
    worker.join()
    return seen, caller[0], caller[1]


def _fill(layout: Layout) -> Path:
    d = layout.ns_root / NS
    d.mkdir(exist_ok=True)
    for i in range(PAGES):
        (d / page_name(i)).write_bytes(b"x")
    return d


def _fill_vllm(layout: Layout) -> Path:
    d = layout.ns_root / NS
    d.mkdir()
    write_blocks(d, write_folder(d), PAGES // 4, size=1)
    return d


@pytest.mark.skipif(os.getpriority(os.PRIO_PROCESS, 0) + RAISED > 19, reason="already nicest")
@pytest.mark.parametrize("work", ["scan", "walk", "unlink"])
def test_the_threads_a_call_starts_run_nicer_than_it_and_its_own_priority_stays(
    layout: Layout, work: str
) -> None:
    """`walk`: the walkers of a vLLM tree's parallel walk (one dir a block or so: no stat
    threads), not niced before."""
    d = _fill(layout) if work != "walk" else _fill_vllm(layout)
    rel = f"{layout.ns_root.relative_to(layout.root)}/{NS}"

    def call() -> None:
        if work in ("scan", "walk"):
            fmt = HICACHE_FILE if work == "scan" else VLLM_FS_TIER
            assert scan_usage(layout, rel, fmt) is not None
        else:
            delete_files(layout.root, rel, sorted(os.listdir(d)), fmt=HICACHE_FILE)
            _fill(layout)  # for the next round, if this one's threads went unseen

    def niced(nice: int) -> int:
        return min(19, nice + NICE)

    seen, before, after = _helpers_seen(call, niced, time.monotonic() + 60)
    assert niced(before) in seen
    assert seen <= {before, niced(before)}  # (one just started has its starter's, briefly)
    assert after == before
