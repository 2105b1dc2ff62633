"""Which engine wrote a namespace, and so which file format its dir follows.

The one table below the identity layer that knows every engine: the watcher, the index, the
scanner, deletion and GC read a namespace's format from its identity record through it. The
rest of an engine is its `Engine` object (cachemgr.engines). A namespace's identity record
names its engine in an `engine` key; no key is SGLang (every namespace made before vLLM).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from cachemgr.backends import FileFormat
from cachemgr.sglang.hicache import HICACHE_FILE
from cachemgr.vllm.fstier import VLLM_FS_TIER

EngineName = Literal["sglang", "vllm"]
DEFAULT_ENGINE: EngineName = "sglang"  # a record without an `engine` key
FORMATS: dict[EngineName, FileFormat] = {"sglang": HICACHE_FILE, "vllm": VLLM_FS_TIER}
DEFAULT_FORMAT = FORMATS[DEFAULT_ENGINE]


def engine_of(identity: Mapping[str, Any] | None) -> EngineName:
    """The engine an identity record names; the default when it names none (or none known)."""
    named = identity.get("engine") if identity is not None else None
    return next((e for e in FORMATS if e == named), DEFAULT_ENGINE)


def format_for(identity: Mapping[str, Any] | None) -> FileFormat:
    """The file format of the namespace with this identity record."""
    return FORMATS[engine_of(identity)]
