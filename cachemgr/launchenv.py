"""The `VAR=value` assignments (and `env`) in front of a launch's program, as a shell runs them:
`env CUDA_VISIBLE_DEVICES=0 python -m sglang.launch_server …`."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

ASSIGN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


def server_environ(command: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """The environment the launch's program runs with: `environ` (what cachemgr hands it), with
    the command's own assignments over it (`env SGLANG_…=/x sglang serve …` wins over ours)."""
    return {**environ, **split_env(command)[0]}


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
