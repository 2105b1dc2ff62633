"""Stands in for `vllm serve` behind `cachemgr exec` in tests; runs inside .vllm-env.

It reads its argv with vLLM's own parser (as `vllm serve` builds it), opens vLLM's own fs tier
(FileSystemTierManager, through tests/vllm_driver.py) where the parsed `--kv-transfer-config`
puts it, with the parsed model and KV dtype, and then stores or loads one prompt's blocks
(STUB_OP=store|load). It prints one JSON line: the tier's folder and what it stored or loaded.
"""

from __future__ import annotations

import json
import logging
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the parser asks for a device

import vllm_driver as driver  # tests/, this script's directory
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

PROMPT = [[11, 64]]  # 4 blocks of 16 tokens


def main() -> None:
    logging.disable(logging.ERROR)  # a load that finds no file is logged at error level
    parser = FlexibleArgumentParser()
    make_arg_parser(parser.add_subparsers().add_parser("serve"))
    args = parser.parse_args(sys.argv[1:])
    tiers = args.kv_transfer_config.kv_connector_extra_config["secondary_tiers"]
    (fs,) = [t for t in tiers if t["type"] == "fs"]
    kv = "bfloat16" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    opened = driver.op_open(
        {"root_dir": fs["root_dir"], "model": args.model_tag, "dtype": kv, "block_tokens": 16}
    )
    request = {"handle": opened["handle"], "tokens": PROMPT, "tag": "stub", "req": "r"}
    run = driver.op_store if os.environ["STUB_OP"] == "store" else driver.op_load
    done = run(request)
    driver.op_close(request)
    print(json.dumps({"root_dir": fs["root_dir"], "base_path": opened["base_path"], **done}))


if __name__ == "__main__":
    main()
