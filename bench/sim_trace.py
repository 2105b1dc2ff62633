"""Recorded traces as input to bench/sim_policy.py and bench/bench_replay.py: Mooncake's
FAST'25 JSON lines (kvcache-ai/Mooncake, `FAST25-release/traces/`, Apache-2.0), and Alibaba's
Bailian schema.

Each line is one request: `timestamp` (ms), `hash_ids` (512-token block ids, chained: an id
always follows the same parent), `input_length`, `output_length`; Bailian's adds `chat_id`,
`parent_chat_id`, `turn` and `type`, and its `timestamp` is in seconds (a file whose first
request has a `chat_id` is read as Bailian's). Bailian's `chat_id` names one request, its
`parent_chat_id` the previous turn (-1: none): a conversation is a chain of them. A block id
is a page; a request's `hash_ids` is the chain it looks up. Page ids are renumbered in order
of first appearance, so a parent's id is below its child's (what the simulator's count of
unusable pages needs). The recorded next turn already carries the previous output, so only
the prompt's blocks are looked up.

Mooncake's conversation and synthetic traces are vendored, gzipped, in bench/traces/ (see its
NOTICE); a name ending in `.gz` is read through gzip, any other as plain text.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any


class TraceError(ValueError):
    """A trace file this reader cannot use (the message names the line)."""


@dataclass(frozen=True)
class Recorded:
    parent: list[int]  # parent page of each page (-1: a chain's first block)
    requests: list[tuple[int, ...]]
    timestamps: list[float]  # seconds
    conversations: int  # chains of parent_chat_id (Bailian), 0 if the trace has none
    types: Counter[str]  # requests by `type` (Bailian)
    relinked: int  # block ids seen after more than one parent (kept at their first)


def open_trace(path: Path) -> IO[str]:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def stamp_of(rec: dict[str, Any], bailian: bool) -> float:
    """The request's arrival in seconds: Mooncake's `timestamp` is in ms, Bailian's in s."""
    raw = float(rec.get("timestamp", 0))
    return raw if bailian else raw / 1000


def read_trace(path: Path, limit: int | None = None) -> Recorded:
    """The trace's first `limit` requests (None: all)."""
    try:
        with open_trace(path) as f:
            return parse(path, f, limit)
    except (EOFError, gzip.BadGzipFile, zlib.error, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: not a readable trace file ({e})") from None


def parse(path: Path, lines: Iterable[str], limit: int | None) -> Recorded:
    ids: dict[object, int] = {}
    parent: list[int] = []
    requests: list[tuple[int, ...]] = []
    stamps: list[float] = []
    root: dict[object, object] = {}  # chat_id -> the chat_id of its conversation's first turn
    bailian: bool | None = None
    types: Counter[str] = Counter()
    relinked = 0
    for n, line in enumerate(lines, 1):
        if limit is not None and len(requests) >= limit:
            break
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            blocks = rec["hash_ids"]
            if bailian is None:
                bailian = "chat_id" in rec
            stamp = stamp_of(rec, bailian)
        except (ValueError, KeyError, TypeError) as e:
            raise TraceError(f"{path}:{n}: not a trace line ({e})") from None
        if not isinstance(blocks, list):
            raise TraceError(f"{path}:{n}: hash_ids is not a list")
        chain: list[int] = []
        for b in blocks:
            up = chain[-1] if chain else -1
            page = ids.get(b)
            if page is None:
                page = ids[b] = len(parent)
                parent.append(up)
            elif parent[page] != up:
                relinked += 1
            chain.append(page)
        requests.append(tuple(chain))
        stamps.append(stamp)
        if "chat_id" in rec:
            up = rec.get("parent_chat_id", -1)
            root[rec["chat_id"]] = root.get(up, rec["chat_id"])
        if "type" in rec:
            types[str(rec["type"])] += 1
    if not requests:
        raise TraceError(f"{path}: no requests")
    return Recorded(parent, requests, stamps, len(set(root.values())), types, relinked)
