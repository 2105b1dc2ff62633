"""Recorded traces as input to bench/sim_policy.py: Mooncake's FAST'25 JSON lines
(kvcache-ai/Mooncake, `FAST25-release/traces/`, Apache-2.0), and Alibaba's Bailian schema.

Each line is one request: `timestamp` (ms), `hash_ids` (512-token block ids, chained: an id
always follows the same parent), `input_length`, `output_length`; Bailian's adds `chat_id`,
`parent_chat_id`, `turn` and `type`. A block id is a page; a request's `hash_ids` is the chain
it looks up. Page ids are renumbered in order of first appearance, so a parent's id is below
its child's (what the simulator's count of unusable pages needs). The recorded next turn
already carries the previous output, so only the prompt's blocks are looked up.

The files are not vendored (3 MB and 1 MB): fetch the repository and pass the path, e.g.
`git -C <mirror of kvcache-ai/Mooncake> show HEAD:FAST25-release/traces/conversation_trace.jsonl`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path


class TraceError(ValueError):
    """A trace file this reader cannot use (the message names the line)."""


@dataclass(frozen=True)
class Recorded:
    parent: list[int]  # parent page of each page (-1: a chain's first block)
    requests: list[tuple[int, ...]]
    timestamps: list[float]  # seconds
    conversations: int  # distinct chat_id (Bailian), 0 if the trace has none
    types: Counter[str]  # requests by `type` (Bailian)
    relinked: int  # block ids seen after more than one parent (kept at their first)


def read_trace(path: Path) -> Recorded:
    ids: dict[object, int] = {}
    parent: list[int] = []
    requests: list[tuple[int, ...]] = []
    stamps: list[float] = []
    chats: set[object] = set()
    types: Counter[str] = Counter()
    relinked = 0
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                blocks = rec["hash_ids"]
                stamp = float(rec.get("timestamp", 0)) / 1000
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
                chats.add(rec["chat_id"])
            if "type" in rec:
                types[str(rec["type"])] += 1
    if not requests:
        raise TraceError(f"{path}: no requests")
    return Recorded(parent, requests, stamps, len(chats), types, relinked)
