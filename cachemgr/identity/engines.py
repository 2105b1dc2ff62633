"""Identity records of either engine, told apart by the record's `engine` key."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from cachemgr.identity.record import Identity
from cachemgr.identity.vllm import VllmIdentity

AnyIdentity = Identity | VllmIdentity


def record_class(data: Any) -> type[Identity] | type[VllmIdentity]:
    """The record type of identity data: `"engine": "vllm"`, else SGLang's (no key)."""
    return VllmIdentity if isinstance(data, dict) and data.get("engine") == "vllm" else Identity


def parse_identity(data: dict[str, Any]) -> AnyIdentity | None:
    """An identity record from its JSON data, None if it is not one this cachemgr reads."""
    try:
        return record_class(data).model_validate(data)
    except ValidationError:
        return None
