"""What a doctor check reports, and the exit code a list of them makes."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from cachemgr.layout import STATE_DIR, Layout

Severity = Literal["error", "warning", "info"]


@dataclass(frozen=True)
class Finding:
    """One problem: how bad, a stable code, what is wrong, how to fix it."""

    severity: Severity
    code: str
    message: str
    fix: str


def exit_code(findings: Sequence[Finding]) -> int:
    """0 clean, 1 warnings, 2 errors."""
    severities = {f.severity for f in findings}
    return 2 if "error" in severities else 1 if "warning" in severities else 0


def command_line(layout: Layout, *args: str) -> str:
    """A cachemgr command on this root and state dir, quoted to paste as it is: without
    `--root`, a fix run from another shell acts on the default root (or finds none), and
    without a state dir of its own, on another DB (one made empty there)."""
    where = ["--root", str(layout.root)]
    if layout.state_dir != layout.root / STATE_DIR:
        where += ["--state-dir", str(layout.state_dir)]
    return shlex.join(["cachemgr", *where, *args])
