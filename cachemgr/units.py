"""Units in one place: durations as people write them, bytes and ages as people read them."""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal
from typing import Any

from pydantic import ByteSize, TypeAdapter, ValidationError

_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
# The words people write for each unit ("2 minutes", "90 sec", "1 hour 30 min"), by unit.
_UNIT_WORDS = {
    "s": ("s", "sec", "secs", "second", "seconds"),
    "m": ("m", "min", "mins", "minute", "minutes"),
    "h": ("h", "hr", "hrs", "hour", "hours"),
    "d": ("d", "day", "days"),
    "w": ("w", "wk", "wks", "week", "weeks"),
}
_UNIT_OF = {word: unit for unit, words in _UNIT_WORDS.items() for word in words}
_PART_RE = re.compile(r"(\d+(?:\.\d+)?|\.\d+)\s*([a-z]+)\s*,?\s*", re.IGNORECASE)
DURATION_FORMS = (
    'a duration: seconds ("90"), a number and a unit ("90s", "5m", "2 minutes", "1h30m", '
    '"1 hour 30 min", "7d", "2w"), or ISO 8601 ("PT5M")'
)
_PYDANTIC_TIMEDELTA: TypeAdapter[timedelta] = TypeAdapter(timedelta)


def parse_duration(value: Any) -> Any:
    """Accept "90s", "5m", "2 minutes", "1h30m", "7d" besides seconds and ISO 8601 ("PT5M").

    A text in none of these forms is a ValueError that lists them: pydantic's own message
    ("invalid character in hour" for "2 minutes") does not say what would have worked.
    """
    if not isinstance(value, str):
        return value
    text = value.strip()
    sign, body = (-1, text[1:].lstrip()) if text.startswith("-") else (1, text)
    try:
        seconds = _seconds(body)
        if seconds is not None:
            return timedelta(seconds=sign * seconds)
        return _PYDANTIC_TIMEDELTA.validate_python(text)  # ISO 8601, "[D] HH:MM:SS"
    except OverflowError:
        raise ValueError("too long a duration (at most 100 years)") from None
    except ValidationError:
        raise ValueError(f"not {DURATION_FORMS}") from None


def _seconds(text: str) -> float | None:
    """The seconds `text` says in cachemgr's own forms, or None if it is in none of them."""
    if re.fullmatch(r"\d+(\.\d+)?|\.\d+", text):  # env vars and flags arrive as strings
        return float(text)
    parts = _PART_RE.findall(text)
    if not parts or "".join(m.group(0) for m in _PART_RE.finditer(text)) != text:
        return None
    if any(word == "M" for _, word in parts):
        # A month to systemd and in ISO 8601's P1M, a minute here: either reading deletes
        # on the wrong scale (a TTL of 1M).
        raise ValueError('"M" is ambiguous: write "min" for minutes, or days ("30d")')
    if any(word.lower() not in _UNIT_OF for _, word in parts):
        return None
    return sum(float(n) * _UNIT_SECONDS[_UNIT_OF[w.lower()]] for n, w in parts)


def whole_bytes(value: Any) -> Any:
    """Refuse a byte size that is no whole number of bytes ("1.5", "1.5B", 1.5): a ValueError.

    pydantic's ByteSize truncates it: CACHEMGR_GC_MAX_BYTES=1.5 was a cap of 1 byte, a GC that
    deletes the whole cache, where the operator meant 1.5 of some unit. The product is taken
    exactly (Decimal): "1.1GB" is whole, though 1.1 * 1e9 is not in floating point. The value
    goes on as given, so pydantic's messages show the operator's own text.
    """
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f'not a whole number of bytes (give a unit: "{value}GB")')
    found = ByteSize.byte_string_re.fullmatch(value.strip()) if isinstance(value, str) else None
    if found is None:
        return value  # a number, or a text pydantic says is wrong
    scalar, unit = found.groups()
    multiplier = ByteSize.byte_sizes.get((unit or "b").lower())
    if multiplier is None:
        return value
    if (Decimal(scalar) * Decimal(multiplier)) % 1:
        hint = f' (give a unit: "{scalar}GB")' if unit is None else ""
        raise ValueError(f"not a whole number of bytes{hint}")
    return value


def format_duration(value: timedelta) -> str:
    """A duration as the docs and the config sample write it, and parse_duration reads it back:
    90 seconds → "1m30s", a week → "7d"."""
    left = value.total_seconds()
    sign, left = ("-", -left) if left < 0 else ("", left)
    parts = []
    for unit in ("d", "h", "m"):
        whole, left = divmod(left, _UNIT_SECONDS[unit])
        if whole:
            parts.append(f"{whole:.0f}{unit}")
    if left or not parts:
        parts.append(f"{left:.6f}".rstrip("0").rstrip(".") + "s")  # timedelta's resolution
    return sign + "".join(parts)


def human_bytes(n: float) -> str:
    """Bytes for people in decimal units, as disks are sold and `du --si` prints: 15.4 GB.

    The one byte formatter of the CLI, doctor and status: every size reads the same everywhere.
    """
    size = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(size) < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def human_age(seconds: float) -> str:
    """A time span in its largest whole unit, as `status` shows ages: 45s, 5m, 3h, 2d."""
    s = max(0.0, seconds)
    for unit in ("d", "h", "m"):
        if s >= _UNIT_SECONDS[unit]:
            return f"{s / _UNIT_SECONDS[unit]:.0f}{unit}"
    return f"{s:.0f}s"
