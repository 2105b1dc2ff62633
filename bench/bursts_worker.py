"""Writes requests' pages through SGLang's own HiCacheFile.batch_set; runs inside .sglang-env.

usage: bursts_worker.py DIR PAGE_BYTES REQUESTS PAGES GAP_SECONDS
Prints the page keys of each request, in the order written, as one JSON list of lists. Each
request's values are made before its batch_set (as SGLang's backup thread has them in host
memory), so a request's pages are written back to back; GAP_SECONDS pass between requests.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from replay_worker import open_ranks  # (bench/ is this script's first import path)


def main() -> None:
    d, page_bytes, requests, pages, gap = sys.argv[1:6]
    backend = open_ranks(d, 1)[0]
    out = []
    for r in range(int(requests)):
        keys = [f"{r:04x}{i:060x}" for i in range(int(pages))]
        values = [torch.randn(int(page_bytes) // 2).to(torch.bfloat16) for _ in keys]
        backend.batch_set(keys, values)
        out.append(keys)
        time.sleep(float(gap))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
