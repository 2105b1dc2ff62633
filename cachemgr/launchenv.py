"""The `VAR=value` assignments (and `env`) in front of a launch's program, as a shell runs them:
`env CUDA_VISIBLE_DEVICES=0 python -m sglang.launch_server …`."""

from __future__ import annotations

import re
from collections.abc import Sequence

ASSIGN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


def split_env(tokens: Sequence[str]) -> tuple[dict[str, str], int]:
    """(the variables set in front of the program, the index of the program's token)."""
    env: dict[str, str] = {}
    i = 0
    while i < len(tokens) and (tokens[i] == "env" or ASSIGN.fullmatch(tokens[i])):
        if tokens[i] != "env":
            key, _, value = tokens[i].partition("=")
            env[key] = value
        i += 1
    return env, i
