"""Identity records of every engine, told apart by the record's `engine` key."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from cachemgr.formats import engine_of
from cachemgr.identity.record import Digested
from cachemgr.sglang.record import Identity
from cachemgr.vllm.identity import VllmIdentity

# Each engine's record class; its ENGINE is the record's `engine` key (cachemgr.formats).
RECORDS: tuple[type[Digested], ...] = (Identity, VllmIdentity)


def record_class(data: Any) -> type[Digested]:
    """The record type of identity data, by its `engine` key (absent: the default engine)."""
    engine = engine_of(data if isinstance(data, dict) else None)
    return next(r for r in RECORDS if engine == r.ENGINE)


def parse_identity(data: dict[str, Any]) -> Digested | None:
    """An identity record from its JSON data, None if it is not one this cachemgr reads."""
    try:
        return record_class(data).model_validate(data)
    except ValidationError:
        return None
