"""Units in one place: durations as people write them, bytes and ages as people read them."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)([smhdw])", re.IGNORECASE)
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(value: Any) -> Any:
    """Accept "90s", "5m", "1h30m", "7d" besides pydantic's seconds and ISO 8601 forms."""
    if not isinstance(value, str):
        return value
    text = value.strip().replace(" ", "")
    if re.fullmatch(r"\d+(\.\d+)?", text):  # env vars and flags arrive as strings
        return timedelta(seconds=float(text))
    if not text or not re.fullmatch(r"(\d+(\.\d+)?[smhdw])+", text, re.IGNORECASE):
        return value  # let pydantic parse (or reject) it
    total = sum(float(n) * _UNIT_SECONDS[u.lower()] for n, u in _DURATION_RE.findall(text))
    return timedelta(seconds=total)


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
