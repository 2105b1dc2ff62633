"""The suite's one way to wait: poll a probe until a condition holds, with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    probe: Callable[[], T],
    until: Callable[[T], bool] = bool,
    *,
    timeout: float = 10.0,
    what: str = "",
    every: float = 0.05,
) -> T:
    """Poll `probe` until `until(value)` and return that value; fail after `timeout` seconds
    naming `what` was awaited and the last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if until(value):
            return value
        if time.monotonic() > deadline:
            waited = f" for {what}" if what else ""
            raise AssertionError(f"timed out after {timeout}s waiting{waited}; last: {value!r}")
        time.sleep(every)
