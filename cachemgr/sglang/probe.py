"""Watching the SGLang server itself: its token-level L3 counters and its real arguments.

`/metrics` gives `sglang:storage_prefetch_hit_tokens_total` (tokens found in L3),
`sglang:prefetched_tokens_total` (tokens loaded from it) and `sglang:backuped_tokens_total`
(tokens written to it); `/server_info` gives the resolved server arguments. If those
arguments contradict the identity of the namespace the server uses, someone launched it
without `cachemgr init`, and every L3 hit it gets may be silently wrong.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from cachemgr.engine import Probe, ProbeHooks, ProbeState
from cachemgr.errors import StateCorrupt, StateLocked

log = logging.getLogger(__name__)
TOKEN_COUNTERS = {
    "sglang:storage_prefetch_hit_tokens": "storage_hit_tokens",
    "sglang:prefetched_tokens": "prefetched_tokens",
    "sglang:backuped_tokens": "backuped_tokens",
}
# (name, help) of the metrics the probe adds to the daemon's /metrics.
METRICS = {
    "cachemgr_sglang_up": "1 if the last scrape of the SGLang server succeeded",
    "cachemgr_sglang_storage_hit_tokens_total": "SGLang's tokens found in L3",
    "cachemgr_sglang_prefetched_tokens_total": "SGLang's tokens loaded from L3",
    "cachemgr_sglang_backuped_tokens_total": "SGLang's tokens written to L3",
}


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


def _explicit_page_size(identity: dict[str, Any]) -> bool:
    """Whether the record's page size is one the server must have (not its own resolution)."""
    src = identity.get("source")
    origin = src.get("page_size_from") if isinstance(src, dict) else None
    return origin in ("flag", "attention_backend")


def _page_difference(info: dict[str, Any], identity: dict[str, Any]) -> str | None:
    page, want = info.get("page_size"), identity.get("page_size")
    if page is None or want is None or int(page) == int(want):
        return None
    return f"page_size: namespace {want} ≠ server {page}"


def contradictions(info: dict[str, Any], identity: dict[str, Any]) -> list[str]:
    """How the running server's arguments differ from a namespace's identity record.

    Only facts that decide the bytes of a page count: kv cache dtype, model path, and the page
    size when the record's was explicit (a flag or a forcing backend). A page size SGLang
    resolved itself (trtllm_mha on SM100, model overrides) is `ambiguities`, not this.
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
    page = _page_difference(info, identity)
    if page is not None and _explicit_page_size(identity):
        out.append(page)
    model = info.get("model_path")
    known = {_norm(str(p)) for p in (source.get("model_path"), source.get("model_dir")) if p}
    if model and known and _norm(str(model)) not in known:
        out.append(f"model_path: namespace {source.get('model_path')} ≠ server {model}")
    return out


def ambiguities(info: dict[str, Any], identity: dict[str, Any]) -> list[str]:
    """Differences that may be the server's own resolution: alarm, never purge on them."""
    page = _page_difference(info, identity)
    return [page] if page is not None and not _explicit_page_size(identity) else []


class ProbeLoop(Probe):
    """Polls the SGLang server; a contradiction with its namespace's identity is handed to
    `hooks.on_mismatch` (the daemon purges that namespace) and raises the alarm in `state`."""

    def __init__(self, url: str, hooks: ProbeHooks, *, interval: float = 15.0) -> None:
        super().__init__("probe", on_death=hooks.on_death)
        self.url = url
        self.instance = hooks.instance
        self.bound = hooks.bound
        self.on_mismatch = hooks.on_mismatch
        self.interval = interval
        self.state = ProbeState()
        self.tokens: SglangTokens | None = None  # the last scrape's L3 token counters

    def families(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "cachemgr_sglang_up", METRICS["cachemgr_sglang_up"], value=self.state.up
        )
        if self.tokens is not None:
            for key in ("storage_hit_tokens", "prefetched_tokens", "backuped_tokens"):
                name = f"cachemgr_sglang_{key}_total"
                yield CounterMetricFamily(name, METRICS[name], value=getattr(self.tokens, key))

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.poll()
            except (StateCorrupt, StateLocked) as e:
                # Moved aside and rebuilt, or locked by another process (a mismatch purge
                # changed nothing then): the next round reads anew, and purges again.
                log.warning("sglang probe skipped a round", extra={"error": str(e)})
            self._stopping.wait(self.interval)

    def _died(self, error: BaseException) -> None:
        # Nobody polls any more: the last scrape's "up" would be stale from now on.
        self.state.up = False
        self.state.last_error = f"probe died: {error}"

    def poll(self) -> None:
        """One round: scrape /metrics, read /server_info, compare with the identity."""
        st = self.state
        try:
            self.tokens = tokens(self.url)
            info = server_info(self.url)
        except (OSError, ValueError) as e:  # URLError is an OSError; bad JSON a ValueError
            st.up = False
            st.last_error = str(e)
            return
        st.up = True
        st.last_error = None
        found = self._namespace()
        if found is None:
            return
        ns, identity, pages = found
        st.namespace = ns
        try:
            diffs = contradictions(info, identity)
            soft = [] if diffs else ambiguities(info, identity)
        except (TypeError, ValueError, OverflowError) as e:
            # A value of the wrong type in /server_info ("page_size": "x", 1e400, {}): not
            # the SGLang server we know how to read; say so and poll again, never die of it.
            st.up = False
            st.last_error = f"/server_info has a value cachemgr cannot read: {e}"
            return
        if not diffs:
            st.alarm = bool(soft)
            if soft:
                log.warning(
                    "SGLang server's page size differs from its namespace's, which SGLang "
                    "resolved itself (no explicit --page-size): NOT purging; pass --page-size "
                    "to `cachemgr init` to pin it",
                    extra={"namespace": ns, "instance": self.instance, "differences": soft},
                )
            return
        if not st.alarm:
            st.mismatches += 1
        st.alarm = True
        log.error(
            "SGLANG SERVER CONTRADICTS ITS NAMESPACE: launched without `cachemgr init`?",
            extra={"namespace": ns, "instance": self.instance, "differences": diffs},
        )
        if pages:
            self.on_mismatch(ns, diffs)

    def _namespace(self) -> tuple[str, dict[str, Any], int] | None:
        """The namespace the instance is bound to, its identity record, and its page count."""
        row = self.bound(self.instance)
        if row is None:
            return None
        try:
            identity = json.loads(row[1])
        except json.JSONDecodeError:
            return None
        return (row[0], identity, row[2]) if isinstance(identity, dict) else None
