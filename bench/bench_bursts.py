"""How many of a request's page stores the chain model links, by page size: SGLang's own
HiCacheFile writing real pages (bench/bursts_worker.py in .sglang-env), then the daemon's
PageEvents applying the stores in the order written, with the burst rule by mtime alone
(the peer: the rule before birth times) and by mtime or birth time (cachemgr now).

usage: python bench/bench_bursts.py [requests=20] [pages=16] [gap=0.02] [workdir=bench/out/bursts]

A request's pages are written by one batch_set, back to back; `gap` seconds pass between
requests, none of which reads (a write-only stream: only time tells requests apart). Printed
per page size: links made within requests (of requests × (pages - 1)) and links made across
requests (wrong: the next request's first page hung on the last one's tail).
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING
from unittest import mock

from cachemgr.daemon import page_events
from cachemgr.daemon.events import LOCAL, Kind
from cachemgr.fs._dirscan import stat_files
from cachemgr.fs.root import create_root
from cachemgr.gc.chains import ChainModel
from cachemgr.layout import Layout
from cachemgr.state.store import Store

if TYPE_CHECKING:
    from cachemgr.fs._dirscan import FileTimes

NS = "00000000000000b1"
SIZES = (64 << 10, 1 << 20, 8 << 20)
SGLANG_PY = Path(__file__).resolve().parent.parent / ".sglang-env" / "bin" / "python"
WORKER = Path(__file__).resolve().parent / "bursts_worker.py"


def write(d: Path, size: int, requests: int, pages: int, gap: float) -> list[list[str]]:
    """Each request's file names, in the order HiCacheFile wrote them."""
    out = subprocess.run(
        [str(SGLANG_PY), str(WORKER), str(d), str(size), str(requests), str(pages), str(gap)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    names = {n[:64]: n for n in os.listdir(d) if n.endswith(".bin")}
    return [[names[k] for k in keys] for keys in json.loads(out.splitlines()[-1])]


def no_births(root: str, files: list[tuple[str, str]]) -> list[FileTimes | None]:
    """stat_files as on a filesystem that keeps no birth time."""
    return [st and (*st[:3], None) for st in stat_files(root, files)]


def links(layout: Layout, order: list[list[str]], births: bool) -> tuple[int, int]:
    """(links within requests, links across them) the model learns from these stores."""
    model = ChainModel()
    events = [(Kind.WRITE, NS, n, 0.0, LOCAL) for req in order for n in req]
    with (
        Store.open(layout.db_path) as store,
        mock.patch.object(page_events, "stat_files", stat_files if births else no_births),
    ):
        page_events.PageEvents(layout, store, model=model).apply(events, now=time.time())
    pred = {k: p.pred for (_, k), p in model.pages.items()}
    within = sum(pred[b[:64]] == a[:64] for req in order for a, b in itertools.pairwise(req))
    across = sum(pred[b[0][:64]] == a[-1][:64] for a, b in itertools.pairwise(order))
    return within, across


def main() -> None:
    requests, pages = int(sys.argv[1]) if len(sys.argv) > 1 else 20, 16
    pages = int(sys.argv[2]) if len(sys.argv) > 2 else pages
    gap = float(sys.argv[3]) if len(sys.argv) > 3 else 0.02
    work = Path(sys.argv[4] if len(sys.argv) > 4 else "bench/out/bursts").resolve()
    print(f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, load {os.getloadavg()}")
    print(f"{requests} requests x {pages} pages, {gap * 1000:.0f} ms between requests, {work}")
    print(
        f"{'page':>9} {'mtime only: within':>19} {'across':>7} {'mtime or birth: within':>23} "
        f"{'across':>7}"
    )
    for size in SIZES:
        shutil.rmtree(work, ignore_errors=True)
        layout = Layout.at(work / "root")
        create_root(layout)
        d = layout.ns_dir(NS)
        d.mkdir()
        order = write(d, size, requests, pages, gap)
        old, new = links(layout, order, False), links(layout, order, True)
        total = requests * (pages - 1)
        row = f"{size >> 10:>6} KiB {old[0]:>12}/{total} {old[1]:>7}"
        print(f"{row} {new[0]:>16}/{total} {new[1]:>7}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
