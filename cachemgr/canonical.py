"""Canonical JSON: the one text of a value whatever its key order and spacing, which identity
digests (and so namespace ids) are taken over and a launch's JSON flags are compared in."""

from __future__ import annotations

import json
from typing import Any


def canonical_json(value: Any, *, ensure_ascii: bool) -> str:
    """`value` as JSON with its keys sorted and no whitespace. `ensure_ascii` stays what each
    caller had when its first digests were taken: escaping non-ASCII text, or no longer
    escaping it, would give every namespace made with such text a new id."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=ensure_ascii)
