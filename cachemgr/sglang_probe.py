"""Watching the SGLang server itself: its token-level L3 counters and its real arguments.

`/metrics` gives `sglang:storage_prefetch_hit_tokens_total` (tokens found in L3),
`sglang:prefetched_tokens_total` (tokens loaded from it) and `sglang:backuped_tokens_total`
(tokens written to it); `/server_info` gives the resolved server arguments. If those
arguments contradict the identity of the namespace the server uses, someone launched it
without `cachemgr init`, and every L3 hit it gets may be silently wrong.
"""

from __future__ import annotations

import json
import os
import urllib.request
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

TOKEN_COUNTERS = {
    "sglang:storage_prefetch_hit_tokens": "storage_hit_tokens",
    "sglang:prefetched_tokens": "prefetched_tokens",
    "sglang:backuped_tokens": "backuped_tokens",
}


@dataclass
class ProbeState:
    """What the daemon last learnt from the SGLang server (read by /metrics)."""

    up: bool = False
    tokens: SglangTokens | None = None
    namespace: str | None = None  # the namespace the server was matched to
    mismatches: int = 0  # identity contradictions found (each one purged its namespace)
    alarm: bool = False  # the last check found a contradiction
    last_error: str | None = None


@dataclass(frozen=True)
class SglangTokens:
    """The server's L3 token counters, summed over its label sets (TP ranks, models)."""

    storage_hit_tokens: float = 0.0
    prefetched_tokens: float = 0.0
    backuped_tokens: float = 0.0


def parse_metrics(text: str) -> SglangTokens:
    """Sum SGLang's L3 token counters out of a Prometheus text exposition."""
    sums = dict.fromkeys(TOKEN_COUNTERS.values(), 0.0)
    for family in text_string_to_metric_families(text):
        key = TOKEN_COUNTERS.get(family.name.removesuffix("_total"))
        if key is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                sums[key] += sample.value
    return SglangTokens(**sums)


def fetch(url: str, timeout: float = 5.0) -> bytes:
    """GET a URL (stdlib only: this runs in a thread of the daemon)."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body: bytes = resp.read()
        return body


def server_info(base_url: str, timeout: float = 5.0) -> dict[str, Any]:
    """The server's resolved arguments from `/server_info`."""
    data = json.loads(fetch(base_url.rstrip("/") + "/server_info", timeout))
    if not isinstance(data, dict):
        raise ValueError("/server_info did not return a JSON object")
    return data


def tokens(base_url: str, timeout: float = 5.0) -> SglangTokens:
    return parse_metrics(fetch(base_url.rstrip("/") + "/metrics", timeout).decode())


def _norm(path: str) -> str:
    return os.path.normpath(path.rstrip("/")) if path else path


def contradictions(info: dict[str, Any], identity: dict[str, Any]) -> list[str]:
    """How the running server's arguments differ from a namespace's identity record.

    Only facts that decide the bytes of a page count: kv cache dtype, page size, model path.
    An argument the server does not report is not a contradiction.
    """
    out = []
    src = identity.get("source")
    source: dict[str, Any] = src if isinstance(src, dict) else {}
    dtype = info.get("kv_cache_dtype")
    if dtype is not None:
        allowed = {identity.get("kv_cache_dtype"), source.get("kv_cache_dtype_arg")}
        if dtype not in allowed:
            out.append(
                f"kv_cache_dtype: namespace {identity.get('kv_cache_dtype')} ≠ server {dtype}"
            )
    page = info.get("page_size")
    want_page = identity.get("page_size")
    if page is not None and want_page is not None and int(page) != int(want_page):
        out.append(f"page_size: namespace {identity['page_size']} ≠ server {page}")
    model = info.get("model_path")
    known = {_norm(str(p)) for p in (source.get("model_path"), source.get("model_dir")) if p}
    if model and known and _norm(str(model)) not in known:
        out.append(f"model_path: namespace {source.get('model_path')} ≠ server {model}")
    return out
