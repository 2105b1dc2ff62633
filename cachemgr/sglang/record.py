"""SGLang's identity record: what decides the byte meaning of a HiCacheFile page.

SGLang's page names carry no dtype, layout or weights (FILE_KEY_SCHEME), so its record
holds them all (docs/identity.md). The record has no `engine` key: absent means SGLang.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from cachemgr.identity.record import Digested, Weights

# 2: page_size may be null (resolved by the server); model_override_args, load_format and
# page_major_kv_layout added.
SCHEMA_VERSION = 2
# How SGLang's file backend names pages (hicache_storage.py HiCacheFile): the key has no dtype,
# layout or weights in it, which is why the namespace must. Bump when SGLang changes it.
FILE_KEY_SCHEME = "sha256-chain_model_tprank_tpsize[_pp][_cp][_dcp].bin"

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class Topology(BaseModel):
    """How each rank's share of the KV is cut (dp replicas share pages, so dp_size is absent)."""

    model_config = _FROZEN
    tp_size: int = 1
    pp_size: int = 1
    attn_dp_size: int = 1
    attn_cp_size: int = 1
    dcp_size: int = 1


class Storage(BaseModel):
    """How the file backend keys pages (the backend itself is always `file` here)."""

    model_config = _FROZEN
    key_scheme: str
    tp_lcm_size: int | None = None  # extra-config key that changes how heads are split


class Source(BaseModel):
    """Where the values came from; informative, not part of the digest."""

    model_config = ConfigDict(frozen=True, extra="allow")
    model_path: str
    model_dir: str
    served_model_name: str
    draft_model_path: str | None = None
    draft_model_dir: str | None = None
    kv_cache_dtype_arg: str = "auto"
    kv_cache_scales_path: str | None = None  # --quantization-param-path as given
    storage_backend: str | None = None
    sglang_version: str | None = None  # full version string, when known
    # namespace: not detectable here, taken from the instance's namespace (prelaunch.py)
    sglang_version_from: Literal["option", "installed", "unknown", "namespace"] = "unknown"
    # flag: --page-size; attention_backend: forced by an explicit backend; server: SGLang
    # decides on the GPU (flag absent, or a model whose overrides rewrite it); unknown: older
    # record. Only flag/attention_backend page sizes may be held against a running server.
    page_size_from: Literal["flag", "attention_backend", "server", "unknown"] = "unknown"


class Identity(Digested):
    """An immutable, versioned identity record of an SGLang server."""

    model_config = ConfigDict(frozen=True, extra="ignore")  # ignore: digest/ns_id are derived
    ENGINE: ClassVar[str] = "sglang"  # no `engine` key in the record: absent means SGLang
    VERSION_FIELD: ClassVar[str] = "sglang_version"
    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"kv_cache_scales"})

    schema_version: Literal[2] = 2
    weights: Weights
    draft_weights: Weights | None = None
    kv_cache_dtype: str
    draft_kv_cache_dtype: str | None = None
    # --quantization-param-path's FP8 KV scales, as "<algo>:<content digest>" (cachemgr.sglang
    # .kvscales); None (and out of the digest) when SGLang loads none.
    kv_cache_scales: str | None = None
    dtype: str
    quantization: str | None = None
    draft_quantization: str | None = None
    page_size: int | None  # None: resolved by the server (see Source.page_size_from)
    hicache_mem_layout: str
    topology: Topology
    mamba_ssm_dtype: str | None = None
    model_override_args: str | None = None  # --json-model-override-args, canonical JSON
    load_format: str | None = None  # only when it does not load the model dir's weights
    page_major_kv_layout: bool = False  # --enable-page-major-kv-layout / --enable-unified-memory
    sglang_version: str
    storage: Storage
    salt: str = ""
    source: Source
