"""Structured logging: one JSON object (or one logfmt line on a terminal) per event."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from cachemgr.settings import LogFormat, LogLevel

# Purpose loggers: named for what their lines are, not for the file that writes them, so an
# operator filters on one stable name. Every other logger is `getLogger(__name__)`.
# The trail of mutating HTTP calls (cachemgr.daemon.mutationlog; docs/daemon.md names it).
HTTP_TRAIL = logging.getLogger("cachemgr.daemon.http")

# Attributes every LogRecord has; anything else was passed with `extra=` and is a field.
_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **fields_of(record),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        kv = " ".join(f"{k}={v}" for k, v in fields_of(record).items())
        line = f"{ts} {record.levelname.lower():7} {record.getMessage()}" + (f" {kv}" if kv else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


# Long work's lines, a second apart: off a terminal, the only sign a purge's drain or a GC
# run is getting on. A one-shot command's default level (warning) hides its info lines, which
# would repeat what it prints at the end, but not these (show_progress).
PROGRESS = logging.getLogger("cachemgr.progress")


def every(period: float) -> Callable[[], bool]:
    """A test that is true at most once every `period` seconds (a progress line's turn)."""
    last = [time.monotonic()]

    def due() -> bool:
        now = time.monotonic()
        if now - last[0] < period:
            return False
        last[0] = now
        return True

    return due


def show_progress() -> None:
    """Show the progress lines under a level that hides the other info lines (until setup)."""
    PROGRESS.setLevel(logging.INFO)


def setup(level: LogLevel, fmt: LogFormat) -> None:
    """Send cachemgr's logs to stderr; quiet libraries stay at warning."""
    PROGRESS.setLevel(logging.NOTSET)  # (the level asked for, until show_progress)
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("cachemgr")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
