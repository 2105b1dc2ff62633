"""Which engine wrote a namespace, and so which file format its dir follows.

A namespace's identity record (its manifest's `identity`) says `"engine": "vllm"` for a vLLM
server's namespace; no `engine` key is SGLang (every namespace made before vLLM support).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from cachemgr.backends import FileFormat
from cachemgr.sglang.hicache import HICACHE_FILE
from cachemgr.vllm.fstier import VLLM_FS_TIER

Engine = Literal["sglang", "vllm"]
ENGINES: tuple[Engine, ...] = ("sglang", "vllm")
FORMATS: dict[Engine, FileFormat] = {"sglang": HICACHE_FILE, "vllm": VLLM_FS_TIER}


def engine_of(identity: Mapping[str, Any] | None) -> Engine:
    """The engine an identity record names; SGLang when it names none (or none is known)."""
    return "vllm" if identity is not None and identity.get("engine") == "vllm" else "sglang"


def format_for(identity: Mapping[str, Any] | None) -> FileFormat:
    """The file format of the namespace with this identity record."""
    return FORMATS[engine_of(identity)]
