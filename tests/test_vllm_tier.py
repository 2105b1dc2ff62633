"""The facts about vLLM's file-system tier that cachemgr's vLLM support builds on, shown with
vLLM 0.34.0's own FileSystemTierManager (docs/vllm-notes.md): where it puts a block, what its
folder name is made of, and that a restarted tier reuses the files already on disk."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from tests.conftest import VllmDriver

pytestmark = pytest.mark.vllm

PROMPT = [[1, 64]]  # 4 blocks of 16 tokens


def test_block_files_sit_in_hashed_dirs_of_a_rank_folder_beside_config(
    vllm: VllmDriver, tmp_path: Path
) -> None:
    opened = vllm.open(tmp_path, block_tokens=16, dtype="bfloat16")
    stored = vllm.call("store", handle=opened["handle"], tokens=PROMPT, tag="a")
    vllm.call("close", handle=opened["handle"])

    base = Path(opened["base_path"])
    assert stored["stored"] == 4 and Path(opened["block_dir"]) == base.with_name(base.name + "_r0")
    for path in map(Path, stored["paths"]):
        rel = path.relative_to(tmp_path).as_posix()
        # <model>_<digest12>_r<rank>/<hash[0:3]>/<hash[3:5]>_g<group>/<hash>.bin
        m = re.fullmatch(
            r"[^/]+_[0-9a-f]{12}_r0/([0-9a-f]{3})/([0-9a-f]{2})_g0/([0-9a-f]{64})\.bin", rel
        )
        assert m and m[3].startswith(m[1] + m[2]), rel
    # The folder's digest is recomputable from its config.json without importing vLLM.
    fields = json.loads((base / "config.json").read_text())
    canon = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    assert (
        base.name
        == f"{fields['model_name'].replace('/', '_')}_{hashlib.sha256(canon).hexdigest()[:12]}"
    )
    assert fields["dtype"] == "bfloat16"


def test_a_restarted_tier_loads_the_blocks_already_on_disk(
    vllm: VllmDriver, tmp_path: Path
) -> None:
    first = vllm.open(tmp_path, block_tokens=16, dtype="bfloat16")["handle"]
    vllm.call("store", handle=first, tokens=PROMPT, tag="a")
    vllm.call("close", handle=first)

    again = vllm.open(tmp_path, block_tokens=16, dtype="bfloat16")["handle"]
    loaded = vllm.call("load", handle=again, tokens=PROMPT, tag="a", req="restart")
    vllm.call("close", handle=again)
    assert (loaded["loaded"], loaded["correct"], loaded["wrong"]) == (4, 4, 0)
