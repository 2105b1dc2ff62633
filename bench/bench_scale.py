"""The seed's directory at scale (issue 23): one flat namespace of millions of pages on a real
ext4 on a loop device (needs root), each figure beside its peer in the same run.

Modes:
  dirlimit [--block-size B]  SGLang-named entries one flat dir takes on an ext4 made without
                             large_dir before ENOSPC, while bytes and inodes are free.
  run N [--evict M] [--layout vllm]
                             N pages in one namespace: cold `du -sb` and `find -delete`
                             against the daemon's first start to ready, a restart from the
                             model file, RSS, the state DB, /metrics p99 during the scan and
                             during an eviction of M pages, status/ls/doctor, doctor on the
                             same dir unadopted, and a purge of the namespace. `--layout
                             vllm`: N blocks in vLLM's hashed dirs instead (vLLM 0.33.0's fs
                             tier, as bench_vllm.py lays them out; no doctor on it unadopted).
  evict N [--evict M] [--find-first] [--unlinks]
                             eviction only: N pages, the daemon restarted under a file cap
                             that takes M of them (default 1M) vs a cold `find -delete` of the
                             same tree (a copy of the same image), /metrics p99 meanwhile.
                             `--unlinks`: also GC's unlinks alone on a third copy (the same M
                             pages by delete_files in GC's chunks, no daemon, no index, no
                             model): the ceiling of the eviction's ratio with its checks.

Usage: python bench/bench_scale.py dirlimit [--block-size 4096]
       python bench/bench_scale.py run 2000000 [--evict 1000000] [--layout vllm]
       python bench/bench_scale.py evict 1200000 [--evict 1000000] [--find-first] [--unlinks]
Set BENCH_DIR to put the image elsewhere than /dev/shm (tmpfs: it takes RAM, ~7 GiB at 10M pages).
`evict`: BENCH_IMAGE=<path> keeps the built, indexed image there and starts the next run from
it; BENCH_PYSPY=<path> writes a py-spy profile of the daemon during the eviction (py-spy on
PATH); BENCH_SCRAPE_EVERY the seconds between /metrics scrapes (0.25).
`run`: BENCH_PYSPY_START=<path> a py-spy profile of the first start to ready.
Both: BENCH_DAEMON_LOG=<dir> keeps each daemon's info log there (serve-<port>.log).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import resource
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import bench_vllm
import httpx
from bench_daemon import free_port, serve_argv, status_kib
from bench_evict import IDENTITY, POLLER, scrapes
from bench_vllm import write_tree

from cachemgr.fs.deletion import delete_files
from cachemgr.fs.dirlimit import flat_dir_index
from cachemgr.fs.root import create_root
from cachemgr.gc.execute import CHUNK
from cachemgr.layout import Layout
from cachemgr.ns.registry import ensure_namespace
from cachemgr.state.store import Store

MODEL = "Qwen-Qwen3-8B"
NS = "00000000000000a1"
PAGE = b"\x03" * 48  # inline in the inode (inline_data): the image stays small
# The SGLang launch `doctor -- <launch>` is timed on (bench_cli.py times it too)
LAUNCH = [
    "python",
    "-m",
    "sglang.launch_server",
    "--model-path",
    "Qwen/Qwen3-8B",
    "--enable-hierarchical-cache",
    "--hicache-storage-backend",
    "file",
]


def page_name(i: int) -> str:
    """An SGLang HiCacheFile page name: a 64-hex key, the model, the TP rank and size."""
    return f"{i:064x}_{MODEL}_0_1.bin"


# A vLLM namespace's identity, as `cachemgr init -- vllm serve` records it: its engine names
# the file format (cachemgr.formats), so the daemon walks the hashed dirs.
VLLM_IDENTITY = {"engine": "vllm", "kv_cache_dtype": "bfloat16", "source": {"model": MODEL}}


def write_vllm(d: Path, n: int) -> int:
    """`n` blocks of PAGE's bytes in vLLM's layout in `d` (bench_vllm's tree): the dirs made,
    `d` with them, which GC leaves (vLLM makes a block's dir, then its file) and which the
    inode count holds too."""
    d.mkdir(parents=True)
    return write_tree(d, n, PAGE)[1] + 1


class Tree:
    """What `run` fills its namespace with: SGLang's flat dir (the seed's) or vLLM's dirs."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.identity = VLLM_IDENTITY if kind == "vllm" else IDENTITY
        self.dirs = 0  # the dirs `write` made, counted among the inodes in use

    def write(self, d: Path, n: int) -> None:
        if self.kind == "vllm":
            self.dirs = write_vllm(d, n)
        else:
            write_pages(d, n)
            self.dirs = 1

    def files(self, mnt: Path) -> int:
        """The files on the filesystem (its inodes in use less the tree's dirs): the pages,
        to a few (the root's own)."""
        return files_in(mnt) - self.dirs


# large_dir always (run and evict): without it a flat dir refuses its ~4.14 millionth entry
# (dirlimit), and a hash tree grows its third level only once two are full, so below that the
# dir is the same. The daemon reads large_dir from the superblock and then sets no dir_full
# cap of its own (cachemgr.fs.dirlimit): only the runs' CACHEMGR_GC_MAX_FILES evicts.
RUN_FS = "inline_data,large_dir"


@contextlib.contextmanager
def loop_ext4(
    base: Path,
    size: int,
    *,
    inodes: int,
    block_size: int = 4096,
    features: str = RUN_FS,
    fresh: bool = True,
    keep: bool = False,
) -> Iterator[Path]:
    """A fresh ext4 of `size` bytes (a sparse image) with `inodes` inodes, loop-mounted
    (`fresh` false: the image there already; `keep`: not removed after)."""
    image, mnt = base / "fs.img", base / "mnt"
    mnt.mkdir(exist_ok=True)
    if fresh:
        _mkfs(image, size, inodes, block_size, features)
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        if not keep:
            image.unlink()


def _mkfs(image: Path, size: int, inodes: int, block_size: int, features: str) -> None:
    with open(image, "wb") as f:
        f.truncate(size)
    subprocess.run(
        [
            "mkfs.ext4",
            "-q",
            "-F",
            "-m",
            "0",
            "-b",
            str(block_size),
            "-N",
            str(inodes),
            "-O",
            features,
            "-E",
            "lazy_itable_init=1,lazy_journal_init=1",
            str(image),
        ],
        check=True,
    )


def fill_dir(d: Path, limit: int | None = None) -> tuple[int, OSError | None]:
    """Empty SGLang-named files in `d` until ENOSPC (or `limit`): how many, and the error."""
    d.mkdir(exist_ok=True)
    n, mode = 0, stat.S_IFREG | 0o644
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        while limit is None or n < limit:
            try:
                os.mknod(page_name(n), mode, dir_fd=fd)
            except OSError as e:
                return n, e
            n += 1
    finally:
        os.close(fd)
    return n, None


# No journal: it does not change how a dir's hash tree fills, and on a shared disk it made the
# fill ten times slower.
DIRLIMIT_FS = "^large_dir,inline_data,^has_journal"


def _image_dir(default: str | None) -> str | None:
    """Where the loop image goes: BENCH_DIR, else `default` (None: the system's temp dir)."""
    return os.environ.get("BENCH_DIR", default)


def bench_dirlimit(block_size: int) -> None:
    """The entries one flat dir takes before ENOSPC on an ext4 without large_dir."""
    # Enough inodes and bytes that neither runs out first (the run checks it did not).
    entries = 12_000_000 if block_size >= 4096 else 400_000
    size = max(64 << 30, entries * 1024) if block_size >= 4096 else 2 << 30
    print(
        f"## flat-dir entry limit: ext4 -b {block_size} -O ^large_dir, names of "
        f"{len(page_name(0))} bytes ({page_name(0)})"
    )
    with (
        tempfile.TemporaryDirectory(prefix="cachemgr-scale-", dir=_image_dir("/dev/shm")) as b,
        loop_ext4(
            Path(b), size, inodes=entries, block_size=block_size, features=DIRLIMIT_FS
        ) as mnt,
    ):
        t0 = time.perf_counter()
        n, err = fill_dir(mnt / "ns")
        took = time.perf_counter() - t0
        st = os.statvfs(mnt)
        dir_bytes = (mnt / "ns").stat().st_size
    print(f"entries before the error: {n:,} ({n / took:,.0f}/s, {took:.0f} s)")
    print(f"error: {err!r}")
    print(
        f"free then: {st.f_bavail * st.f_frsize / 2**30:.1f} GiB, {st.f_favail:,} inodes; "
        f"the dir itself {dir_bytes / 2**20:.0f} MiB"
    )
    assert err is not None and st.f_favail > 0 and st.f_bavail > 0


def cold() -> None:
    """Write back and drop the page, dentry and inode caches: the next reads hit the disk."""
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def timed_cmd(*cmd: str, env: dict[str, str] | None = None) -> tuple[float, str]:
    """Seconds a command took, and its stdout (a non-zero exit is fine: doctor's 1 and 2)."""
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    return time.perf_counter() - t, out.stdout


def write_pages(d: Path, n: int) -> None:
    """`n` SGLang-named pages of PAGE's bytes in `d`, with old mtimes (no min_age holds them)."""
    d.mkdir(parents=True)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(n):
            f = os.open(page_name(i), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=fd)
            os.write(f, PAGE)
            os.close(f)
    finally:
        os.close(fd)


class Served:
    """`cachemgr serve` on a loopback port, its /metrics scraped by POLLER from the start."""

    def __init__(
        self, layout: Layout, env: dict[str, str], every: float = 0.05, spy: str | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.t0 = time.monotonic()
        logs = os.environ.get("BENCH_DAEMON_LOG")  # a dir: each daemon's info log there
        out = Path(logs) / f"serve-{self.port}.log" if logs else Path(os.devnull)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "wb") as err:  # (the child keeps its own copy of the fd)
            self.proc = subprocess.Popen(
                serve_argv(layout, self.port, level="info" if logs else "warning"),
                stderr=err,
                env={**os.environ, **env},
            )
        # A raw py-spy profile of the start to ready at `spy`.
        self.spy = spy and subprocess.Popen([*PYSPY, "-p", str(self.proc.pid), "-o", spy])
        self.poller = subprocess.Popen(
            [sys.executable, "-c", POLLER_TOLERANT, f"{self.url}/metrics", str(every)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.ready = self._wait_ready()
        if self.spy:
            self.spy.send_signal(signal.SIGINT)
            self.spy.wait()
        # Ready before GC may run: a restart from the model file scans what changed while down,
        # a first start loads GC's model.
        self.settled: float | None = None
        threading.Thread(target=self._wait_settled, daemon=True).start()

    def _wait_settled(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while self.proc.poll() is None:
                with contextlib.suppress(httpx.TransportError):
                    if "GC starts after" not in client.get("/readyz").json()["detail"]:
                        self.settled = time.monotonic() - self.t0
                        return
                time.sleep(0.1)

    def _wait_ready(self) -> float:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"cachemgr serve exited with {self.proc.returncode}")
                with contextlib.suppress(httpx.TransportError):
                    if client.get("/readyz").status_code == 200:
                        return time.monotonic() - self.t0
                time.sleep(0.05)

    def rss(self) -> tuple[float, float]:
        """RSS now and its peak, MiB."""
        pid = self.proc.pid
        return status_kib(pid, "VmRSS") / 1024, status_kib(pid, "VmHWM") / 1024

    def scrapes(self) -> list[tuple[float, float]]:
        """Stop the poller: (start, seconds) of each scrape, on time.monotonic()."""
        out, _ = self.poller.communicate("", timeout=60)
        return [tuple(x) for x in json.loads(out)]

    def stop(self) -> float:
        t = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(1800)  # (it saves the model file: minutes at 10M pages)
        return time.perf_counter() - t


# bench_evict's POLLER, which fails on a refused connection: the daemon is not listening yet
# in its first tenths of a second.
POLLER_TOLERANT = POLLER.replace(
    "        http.get(url).raise_for_status()\n",
    "        try:\n            http.get(url).raise_for_status()\n"
    "        except httpx.TransportError:\n            done.wait(every); continue\n",
)


def say(line: str) -> None:
    """A figure, with the UTC time and the load average it was taken at (the box is shared),
    at once: a long run read as it goes, or cut short, keeps what it measured."""
    stamp = time.strftime("%H:%M:%S", time.gmtime())
    print(f"{line} [{stamp} UTC, load {os.getloadavg()[0]:.1f}]", flush=True)


def between(scraped: list[tuple[float, float]], a: float, b: float) -> list[float]:
    return [sec for t, sec in scraped if a <= t <= b]


def files_in(path: Path) -> int:
    """Inodes used on the filesystem: the pages, to a few (the root's own files)."""
    st = os.statvfs(path)
    return st.f_files - st.f_ffree


def bench_run(n: int, evict: int, tree: Tree) -> None:
    """The figures of issue 23 at `n` pages in one namespace, each beside its peer (the
    restart's file cap evicts `evict` of them)."""
    vllm = tree.kind == "vllm"  # ~0.64 leaf dirs a block, each a block of its own
    inodes = int(n * (2.0 if vllm else 1.3)) + 20_000
    size = max(4 << 30, n * (6144 if vllm else 2048))
    with (
        tempfile.TemporaryDirectory(prefix="cachemgr-scale-", dir=_image_dir("/dev/shm")) as b,
        loop_ext4(Path(b), size, inodes=inodes) as mnt,
    ):
        index = flat_dir_index(mnt)
        say(f"dir index: {index}; flat-dir entry limit {index and index.limit()}")
        run_on(mnt, n, evict, tree)


def settle_seconds(n: int) -> float:
    """How long a daemon is left running before its steady RSS is read: 10 s from 1M pages
    up (the sizes RESULTS.md quotes), a second for the test's 20,000 (ready in well under one)."""
    return min(10.0, max(1.0, n / 100_000))


def run_on(mnt: Path, n: int, evict: int, tree: Tree) -> None:
    plain = mnt / "plain"
    t = time.perf_counter()
    tree.write(plain, n)
    say(f"made {n:,} pages ({tree.kind}: {tree.dirs:,} dirs) in {time.perf_counter() - t:.0f} s")
    layout = Layout.at(mnt / "root")
    create_root(layout)
    cold()
    du, _ = timed_cmd("du", "-sb", str(plain))
    if tree.kind == "vllm":  # (doctor's launch below is SGLang's)
        say(f"cold du -sb: {du:.1f} s")
    else:
        doctor_unadopted(layout, plain, du)
    os.rename(plain, layout.ns_dir(NS))
    with Store.open(layout.db_path) as store:
        ensure_namespace(
            layout, store, ns_id=NS, digest=NS * 4, identity=tree.identity, now=time.time()
        )
    start_and_stop(mnt, layout, n, du)
    evict_and_purge(mnt, n, evict, tree)


def doctor_unadopted(layout: Layout, plain: Path, du: float) -> None:
    """`doctor -- <SGLang's launch>` on the dir before any cachemgr state knows it, cold."""
    cold()
    doctor_plain, _ = timed_cmd(
        sys.executable,
        "-m",
        "cachemgr",
        "--root",
        str(layout.root),
        "doctor",
        "--",
        *LAUNCH,
        env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(plain)},
    )
    say(
        f"cold du -sb: {du:.1f} s; doctor on it unadopted (cold): {doctor_plain:.1f} s "
        f"({doctor_plain / du:.2f}× du)"
    )


def start_and_stop(mnt: Path, layout: Layout, n: int, du: float) -> None:
    """The first start (to ready, RSS, /metrics meanwhile), the CLI beside it, the stop."""
    empty = Layout.at(mnt / "empty")
    create_root(empty)
    base = Served(empty, {})
    time.sleep(settle_seconds(n) / 2)
    base_rss = base.rss()[0]
    base.stop()
    base.scrapes()
    cold()
    first = Served(layout, {}, spy=os.environ.get("BENCH_PYSPY_START"))
    while first.settled is None and first.proc.poll() is None:  # (GC's model loads after ready)
        time.sleep(0.1)
    time.sleep(settle_seconds(n))
    rss, peak = first.rss()
    say(
        f"first start, cold caches: ready {first.ready:.1f} s ({first.ready / du:.2f}× cold du), "
        f"GC may run from {first.settled:.1f} s; "
        f"RSS {rss:.0f} MiB steady, {peak:.0f} MiB peak; empty daemon {base_rss:.0f} MiB: "
        f"{(rss - base_rss) * 2**20 / n:.0f} B/page steady, {(peak - base_rss) * 2**20 / n:.0f} "
        f"B/page peak"
    )
    # The daemon's port: a command that asks the default one finds no daemon and scans the
    # dir instead (the 2M runs' 13-245 s, and the 10M run's first figures: bench/RESULTS.md).
    asks = {"CACHEMGR_PORT": str(first.port)}
    for label, cmd in (("status", ["status"]), ("ls", ["ls"]), ("doctor", ["doctor"])):
        took, _ = timed_cmd(
            sys.executable, "-m", "cachemgr", "--root", str(layout.root), *cmd, env=asks
        )
        say(f"`cachemgr {label}`: {took:.2f} s (daemon running)")
    stopped = first.stop()
    scan = between(first.scrapes(), first.t0, first.t0 + first.ready)
    say(f"/metrics during the first scan: {scrapes(scan)}")
    db = sum(p.stat().st_size for p in layout.state_dir.glob("state.db*"))
    snap = layout.model_snapshot.stat().st_size if layout.model_snapshot.exists() else 0
    say(
        f"state DB {db / 2**20:.0f} MiB ({db / n:.0f} B/page); model file {snap / 2**20:.0f} "
        f"MiB; stopped in {stopped:.1f} s"
    )


def evict_and_purge(mnt: Path, n: int, evict: int, tree: Tree) -> None:
    """The indexed root restarted under a file cap that evicts `evict` of its `n` pages, a
    purge of what is left, and `find -delete` of that beside the eviction."""
    layout = Layout.at(mnt / "root")
    env = evict_env(n, evict)
    cap = int(env["CACHEMGR_GC_MAX_FILES"])
    again = Served(layout, {**env, "CACHEMGR_GC_INTERVAL": "5s"})
    t0 = time.monotonic()
    low = floor_of(cap)
    first = wait_evicted(again, lambda: tree.files(mnt), n, low)
    evicted = time.monotonic() - t0
    time.sleep(3)
    left = pages_under(layout.ns_dir(NS))
    rate = (n - left) / evicted
    # GC's run itself, what find -delete compares with (from ready adds the restart's rescan)
    run_rate = (n - left) / (t0 + evicted - first) if first is not None else rate
    settled = f"{again.settled:.1f} s" if again.settled is not None else "not yet"
    say(
        f"restart from the model file, CACHEMGR_GC_MAX_FILES={cap}: ready {again.ready:.1f} s "
        f"(GC may run from {settled}); "
        f"evicted {n - left:,} pages in {evicted:.1f} s after ready ({rate:,.0f}/s); "
        f"{left:,} left (cap {cap:,}, low watermark {low:,})"
    )
    drained = purge(layout, mnt)
    again.stop()
    say_windows(again.scrapes(), t0, first, t0 + evicted)
    cold()
    took, _ = timed_cmd("find", str(layout.trash), "-type", "f", "-delete")
    say(
        f"find -delete of the {drained:,} left in .trash, cold: {took:.1f} s "
        f"({drained / took:,.0f}/s); cachemgr's eviction / find -delete = "
        f"{rate / (drained / took):.3g} from ready, "  # not .2f: a slow one printed 0.00
        f"{run_rate / (drained / took):.3g} from its first deletion ({run_rate:,.0f}/s)"
    )


def pages_under(d: Path) -> int:
    """The page files (`*.bin`, both engines' names) below `d`."""
    found = subprocess.run(
        ["find", str(d), "-type", "f", "-name", "*.bin", "-printf", "."],
        capture_output=True,
        check=True,
    )
    return len(found.stdout)


def purge(layout: Layout, mnt: Path) -> int:
    """`cachemgr purge --no-wait` of the namespace while the daemon serves it: the time until
    the dir is the server's again (empty), and the daemon's paced drain of .trash/ for a
    while (files and dirs: entries); the page files left in .trash/."""
    pages = pages_under(layout.ns_dir(NS))
    before = files_in(mnt)
    took, _ = timed_cmd(
        sys.executable,
        "-m",
        "cachemgr",
        "--root",
        str(layout.root),
        "purge",
        "--namespace",
        NS,
        "--yes",
        "--no-wait",
    )
    empty = not os.listdir(layout.ns_dir(NS)) if layout.ns_dir(NS).exists() else True
    t = time.monotonic()
    while files_in(mnt) >= before - 10 and time.monotonic() - t < WAIT_DRAIN:
        time.sleep(0.1)  # the GC cycle that starts the drain
    began = time.monotonic() - t
    start, t = files_in(mnt), time.monotonic()
    time.sleep(min(15.0, pages / 4000))  # about half of them at the default rate, at most 15 s
    rate = (start - files_in(mnt)) / (time.monotonic() - t)
    say(
        f"purge of the {pages:,} left: the dir {'empty' if empty else 'NOT empty'} after "
        f"{took:.2f} s (the CLI); the drain's first deletions "
        + (f"{began:.1f} s after it" if began < WAIT_DRAIN else f"not within {WAIT_DRAIN} s")
        + f"; the daemon drains .trash/ at {rate:,.0f} entries/s (gc_delete_rate 2000)"
    )
    return pages_under(layout.trash)


WAIT_DRAIN = 120  # s: a drain that counted its entry first took minutes at 9M files


def cap_leaving(low: int) -> int:
    """The file cap whose low watermark (floor_of) is `low` files."""
    return int(low / 0.85) + 1


# A high watermark just above the low one: with the default 0.95 a cap whose low watermark
# leaves n - m pages starts no GC unless m > 10.5% of n (the 10M run's 1M did not: it waited
# with 10,000,000 files under a high watermark of 10,058,824).
HIGH_WATERMARK = 0.86


def evict_env(n: int, evict: int) -> dict[str, str]:
    """The daemon's settings for a GC run that takes `evict` of `n` pages at once."""
    cap = cap_leaving(n - evict)
    if n <= cap * HIGH_WATERMARK:
        raise ValueError(f"evicting {evict:,} of {n:,} starts no GC (high watermark)")
    return {
        "CACHEMGR_GC_MAX_FILES": str(cap),
        "CACHEMGR_GC_HIGH_WATERMARK": str(HIGH_WATERMARK),
        "CACHEMGR_GC_MIN_AGE": "0s",
    }


def floor_of(cap: int) -> int:
    """The low watermark of a file cap with the default watermarks."""
    return int(cap * 0.85)


def bench_evict_only(n: int, evict: int, find_first: bool, unlinks: bool) -> None:
    """Eviction of `evict` of `n` pages by the daemon's GC (a file cap) beside a cold
    `find -delete` of the same tree: a copy of the same image, mounted in turn (`unlinks`:
    and GC's unlinks alone, on a third copy)."""
    inodes = int(n * 1.3) + 20_000
    size = max(4 << 30, n * 2048)
    saved = os.environ.get("BENCH_IMAGE")  # a built image kept there: the next run starts at it
    with tempfile.TemporaryDirectory(prefix="cachemgr-scale-", dir=_image_dir("/dev/shm")) as b:
        base = Path(b)
        if saved and Path(saved).exists():
            subprocess.run(["cp", "--sparse=always", saved, str(base / "fs.img")], check=True)
        else:
            build_indexed(base, n, size, inodes)
            if saved:
                subprocess.run(["cp", "--sparse=always", str(base / "fs.img"), saved], check=True)
        peer, alone = base / "peer", base / "alone"
        for copy in (peer, alone) if unlinks else (peer,):
            copy.mkdir()
            subprocess.run(["cp", "--sparse=always", str(base / "fs.img"), str(copy)], check=True)
        if unlinks:
            with loop_ext4(alone, size, inodes=inodes, fresh=False) as mnt:
                alone_rate = unlinks_on(mnt, evict)
        for contender in ("find", "cachemgr") if find_first else ("cachemgr", "find"):
            print(f"load {os.getloadavg()[0]:.1f} before {contender}", flush=True)
            if contender == "find":
                with loop_ext4(peer, size, inodes=inodes, fresh=False) as mnt:
                    cold()
                    cpu = children_cpu()
                    took, _ = timed_cmd(
                        "find", str(Layout.at(mnt / "root").ns_dir(NS)), "-type", "f", "-delete"
                    )
                    cpu = children_cpu() - cpu
                    find_rate = n / took
                    print(
                        f"find -delete of {n:,} pages, cold: {took:.2f} s ({find_rate:,.0f}/s), "
                        f"{cpu:.1f} CPU seconds ({cpu / n * 1e6:.0f} µs a file)"
                    )
            else:
                with loop_ext4(base, size, inodes=inodes, fresh=False) as mnt:
                    rate, run_rate = evict_on(mnt, n, evict)
    print(
        f"cachemgr's eviction / find -delete = {rate / find_rate:.3g} from ready, "
        f"{run_rate / find_rate:.3g} from its first deletion (load {os.getloadavg()[0]:.1f})"
    )
    if unlinks:
        print(f"GC's unlinks alone / find -delete = {alone_rate / find_rate:.3g}")


def unlinks_on(mnt: Path, evict: int) -> float:
    """GC's unlinks alone: `evict` pages, in the index's recency order, by delete_files in
    GC's chunks with its per-file checks, cold, no daemon, index nor model; files/s."""
    layout = Layout.at(mnt / "root")
    with contextlib.closing(sqlite3.connect(layout.db_path)) as c:
        names = [
            name
            for (name,) in c.execute(
                "SELECT name FROM pages WHERE namespace_id = ? "
                "ORDER BY last_access, access_seq LIMIT ?",
                (NS, evict),
            )
        ]
    cold()
    cpu, t = bench_vllm.cpu(), time.perf_counter()  # (the C unlinkers are threads of ours)
    done = sum(
        delete_files(layout.root, f"ns/{NS}", names[i : i + CHUNK]).files
        for i in range(0, len(names), CHUNK)
    )
    took, cpu = time.perf_counter() - t, bench_vllm.cpu() - cpu
    print(
        f"GC's unlinks alone (delete_files in chunks of {CHUNK}: no index, no model) deleted "
        f"{done:,} pages, cold: {took:.2f} s ({done / took:,.0f}/s), {cpu:.1f} CPU seconds "
        f"({cpu / max(1, done) * 1e6:.0f} µs a file)",
        flush=True,
    )
    return done / took


def build_indexed(base: Path, n: int, size: int, inodes: int) -> None:
    """An image at base/fs.img with `n` pages in one namespace, indexed by a first start."""
    with loop_ext4(base, size, inodes=inodes, keep=True) as mnt:
        layout = Layout.at(mnt / "root")
        create_root(layout)
        t = time.perf_counter()
        write_pages(layout.ns_dir(NS), n)
        print(f"made {n:,} pages in one dir in {time.perf_counter() - t:.0f} s")
        with Store.open(layout.db_path) as store:
            ensure_namespace(
                layout, store, ns_id=NS, digest=NS * 4, identity=IDENTITY, now=time.time()
            )
        first = Served(layout, {})  # the index built once: the restart below rescans
        # Stopped once GC's model is loaded, so that the image holds its model file, as the
        # dir of a daemon that ran does: stopped at ready, the restart loaded the model from
        # the index (~20 µs a page), and that wait counted as eviction time.
        while first.settled is None and first.proc.poll() is None:
            time.sleep(0.1)
        print(f"first start to ready: {first.ready:.1f} s; GC may run from {first.settled:.1f} s")
        first.stop()
        first.scrapes()


SCRAPE_EVERY = float(os.environ.get("BENCH_SCRAPE_EVERY", "0.25"))
# py-spy: on PATH or beside this Python (`pip install py-spy` into the venv)
SPY = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
PYSPY = [SPY, "record", "--threads", "--rate", "40", "--format", "raw", "--native", "--idle"]


def children_cpu() -> float:
    """CPU seconds (user + system) of the children waited for so far."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of `pid` (by tid), and of the process."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            f = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[task.name] = (int(f[11]) + int(f[12])) / tick
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    out["process"] = (int(f[11]) + int(f[12])) / tick
    return out


def thread_names(pid: int) -> dict[str, str]:
    """tid -> Python thread name, by py-spy dump (empty without py-spy)."""
    try:
        out = subprocess.run([SPY, "dump", "-p", str(pid)], capture_output=True, text=True)
    except OSError:
        return {}
    return dict(re.findall(r'Thread (\d+) \(\w+\): "([^"]+)"', out.stdout))


def evict_on(mnt: Path, n: int, evict: int) -> tuple[float, float]:
    """The daemon restarted under a file cap that leaves n - evict pages: files/s after ready
    (caches dropped at ready) and from its first deletion, with /metrics latency meanwhile."""
    layout = Layout.at(mnt / "root")
    low = n - evict
    env = evict_env(n, evict)
    cap = int(env["CACHEMGR_GC_MAX_FILES"])
    cold()
    # Scraped 4 times a second (Prometheus: every 15 s): 20 a second cost the daemon a
    # fifth of its GIL time during the eviction, the bench's own load, not cachemgr's.
    served = Served(layout, {**env, "CACHEMGR_GC_INTERVAL": "5s"}, every=SCRAPE_EVERY)
    cold()  # the restart's rescan read every inode: the eviction starts cold, as find does
    t0 = time.monotonic()
    spy = os.environ.get("BENCH_PYSPY")  # a raw py-spy profile of the eviction there
    prof = spy and subprocess.Popen([*PYSPY, "-p", str(served.proc.pid), "-o", spy])
    cpu0 = thread_cpu(served.proc.pid)
    first = wait_evicted(served, lambda: files_in(mnt), n, low)
    took = time.monotonic() - t0
    cpu1 = thread_cpu(served.proc.pid)
    names = thread_names(served.proc.pid)
    cpu = {names.get(k, k): round(v - cpu0.get(k, 0), 1) for k, v in cpu1.items()}
    print(
        f"CPU seconds during the eviction, by thread (process less threads: the C unlinkers; "
        f"{cpu['process'] / evict * 1e6:.0f} µs a file in all): {cpu}"
    )
    if prof:
        prof.send_signal(signal.SIGINT)
        prof.wait()
    time.sleep(2)
    left = len(os.listdir(layout.ns_dir(NS)))
    served.stop()
    rate = (n - left) / took
    run = took - ((first or t0) - t0)
    print(
        f"restart under CACHEMGR_GC_MAX_FILES={cap:,}: ready {served.ready:.1f} s; evicted "
        f"{n - left:,} pages in {took:.1f} s after ready ({rate:,.0f}/s), "
        f"{run:.1f} s from the first deletion ({(n - left) / run:,.0f}/s); {left:,} left "
        f"(low watermark {floor_of(cap):,})"
    )
    say_windows(served.scrapes(), t0, first, t0 + took)
    return rate, (n - left) / run


def wait_evicted(served: Served, files: Callable[[], int], n: int, low: int) -> float | None:
    """Wait until `files()` (of `n` at the start) is down to `low` (to the root's own few);
    when the first page went (None: none seen going), for GC's run from there, beside find's
    (from ready adds the restart's rescan)."""
    first = None
    while (now := files()) > low + 100:
        if served.proc.poll() is not None:
            raise RuntimeError(f"cachemgr serve exited with {served.proc.returncode}")
        if first is None and now < n - 100:
            first = time.monotonic()
        time.sleep(0.05)
    return first


def say_windows(
    scraped: list[tuple[float, float]], t0: float, first: float | None, end: float
) -> None:
    """/metrics from ready to the eviction's end, then in its two parts: before the first
    page went (the restart's rescan, GC's model loading) and GC's run itself. The 10M runs'
    p99 over the whole window (19.4-30.9 ms) did not say which part it came from."""
    say(f"/metrics during the eviction, from ready: {scrapes(between(scraped, t0, end))}")
    if first is not None:
        say(f"/metrics before its first deletion: {scrapes(between(scraped, t0, first))}")
        run = between(scraped, first, end)
        say(f"/metrics during GC's run, from its first deletion: {scrapes(run)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    dl = sub.add_parser("dirlimit")
    dl.add_argument("--block-size", type=int, default=4096)
    run = sub.add_parser("run")
    run.add_argument("pages", type=int)
    run.add_argument("--evict", type=int, default=1_000_000)
    run.add_argument("--layout", choices=("sglang", "vllm"), default="sglang")
    ev = sub.add_parser("evict")
    ev.add_argument("pages", type=int)
    ev.add_argument("--evict", type=int, default=1_000_000)
    ev.add_argument("--find-first", action="store_true")
    ev.add_argument("--unlinks", action="store_true")
    args = ap.parse_args()
    if args.mode != "dirlimit" and not 0 < args.evict < args.pages:
        ap.error(f"--evict {args.evict} must leave some of the {args.pages} pages")
    print(
        f"# cachemgr scale bench — {platform.node()}, {os.cpu_count()} cores, "
        f"{platform.platform()}, load {os.getloadavg()[0]:.1f}"
    )
    if args.mode == "dirlimit":
        bench_dirlimit(args.block_size)
    elif args.mode == "evict":
        bench_evict_only(args.pages, args.evict, args.find_first, args.unlinks)
    else:
        bench_run(args.pages, args.evict, Tree(args.layout))


if __name__ == "__main__":
    main()
