"""A tiny model directory for the deploy tests: what `cachemgr init` fingerprints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def make_model(path: Path) -> Path:
    """A config.json and one small safetensors shard, enough for an identity."""
    path.mkdir(parents=True, exist_ok=True)
    save_file({"w": np.arange(64, dtype=np.float32)}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    return path
