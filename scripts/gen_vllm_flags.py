"""Regenerate cachemgr/vllm/flags.py from an installed vLLM's own argument parser.

Run with the Python of .vllm-env; on a host without a GPU vLLM needs to be told its device:
    VLLM_TARGET_DEVICE=cpu .vllm-env/bin/python scripts/gen_vllm_flags.py > cachemgr/vllm/flags.py
Importing vLLM's parser costs ~10 s and ~540 MB, so cachemgr reads this table, never the parser.
"""

import ast
import importlib.metadata
import inspect
import os
import typing
from pathlib import Path

import vllm
import vllm.envs
from flagtable import IMPORTS, choice_lines, read_table, words
from vllm.config.cache import _LAYOUT_COMPAT_ALIASES
from vllm.config.load import LoadConfig
from vllm.config.model import ModelConfig
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.model_executor.layers.quantization import (
    DEPRECATED_QUANTIZATION_METHODS,
    QuantizationMethods,
)
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import KVCacheSpecKind

LAYOUT_ENV = "VLLM_KV_CACHE_LAYOUT"

# The settings an identity for vLLM's fs tier needs (docs/vllm.md), by argparse dest.
IDENTITY_DESTS = (
    "model_tag",
    "model",
    "revision",
    "code_revision",
    "tokenizer",
    "tokenizer_revision",
    "dtype",
    "kv_cache_dtype",
    "kv_cache_dtype_skip_layers",
    "mamba_cache_dtype",
    "mamba_ssm_cache_dtype",
    "block_size",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "decode_context_parallel_size",
    "prefill_context_parallel_size",
    "max_model_len",
    "hf_overrides",
    "hf_config_path",
    "attention_backend",
    "attention_config",
    "allow_deprecated_quantization",
    "quantization",
    "prefix_caching_hash_algo",
    "kv_transfer_config",
    "served_model_name",
    "load_format",
    "download_dir",
)


def kv_layouts() -> list[str]:
    """The VLLM_KV_CACHE_LAYOUT values vllm/envs.py accepts: the choices its env_with_choices
    getter closes over, each probed, and checked to be case-sensitive (cachemgr compares so)."""
    getter = vllm.envs.environment_variables[LAYOUT_ENV]
    choices = list(inspect.getclosurevars(getter).nonlocals["choices"])
    saved = os.environ.get(LAYOUT_ENV)
    try:
        for value in choices:
            os.environ[LAYOUT_ENV] = value
            if getter() != value:
                raise SystemExit(f"{LAYOUT_ENV}={value} does not read back as itself")
        for value in ["", *(c.lower() for c in choices)]:
            os.environ[LAYOUT_ENV] = value
            try:
                getter()
            except ValueError:
                continue
            raise SystemExit(f"{LAYOUT_ENV}={value!r} is accepted: no longer case-sensitive")
    finally:
        os.environ.pop(LAYOUT_ENV, None)
        if saved is not None:
            os.environ[LAYOUT_ENV] = saved
    return choices


def load_formats() -> list[str]:
    """The keys of model_loader's _LOAD_FORMAT_TO_MODEL_LOADER (what get_model_loader takes),
    read from its source: importing the module needs GPU-side packages a CPU env lacks."""
    path = Path(vllm.__file__).parent / "model_executor" / "model_loader" / "__init__.py"
    for node in ast.parse(path.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id == "_LOAD_FORMAT_TO_MODEL_LOADER":
            assert isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Dict)
            return [ast.literal_eval(k) for k in node.value.keys if k is not None]
    raise SystemExit(f"no _LOAD_FORMAT_TO_MODEL_LOADER in {path}")


def check_lowercased() -> None:
    """cachemgr lowercases --quantization and --load-format as vLLM's configs do (ModelConfig's
    and LoadConfig's validators): fail the regeneration if vLLM stops doing so."""
    if ModelConfig.validate_quantization_before("FP8") != "fp8":
        raise SystemExit("vLLM no longer lowercases --quantization")
    if LoadConfig(load_format="SAFETENSORS").load_format != "safetensors":
        raise SystemExit("vLLM no longer lowercases --load-format")


def main() -> None:
    parser = make_arg_parser(FlexibleArgumentParser())
    by_dest = {a.dest: a for a in parser._actions}
    missing = [d for d in IDENTITY_DESTS if d not in by_dest]
    if missing:  # a renamed flag must fail the regeneration, not silently drop a setting
        raise SystemExit(f"vLLM has no flag for: {' '.join(missing)}")
    table = read_table(parser._actions, set(IDENTITY_DESTS))
    aliases: dict[str, str] = {}
    for dest in IDENTITY_DESTS:
        strings = by_dest[dest].option_strings
        longs = [o for o in strings if o.startswith("--")]
        aliases.update({o: longs[0] for o in strings if not o.startswith("--")})
    version = importlib.metadata.version("vllm")
    alias_lines = "\n".join(f'    "{k}": "{v}",' for k, v in sorted(aliases.items()))
    layouts = kv_layouts()
    check_lowercased()
    layout_aliases = "\n".join(
        f'    "{k}": "{v}",' for k, v in sorted(_LAYOUT_COMPAT_ALIASES.items())
    )
    print(f'''"""Which vLLM {version} `vllm serve` flags take no value, which take several,
and which values vLLM accepts for the settings cachemgr reads.

Generated by scripts/gen_vllm_flags.py from vLLM's own argparse parser; do not edit.
vLLM's FlexibleArgumentParser rewrites argv first (`_` = `-` in flag names, `--config FILE`,
`-O3`, dotted keys such as `--hf-overrides.rope_scaling.factor 4`): cachemgr/vllm/argv.py
does the same before these tables are consulted.
"""

{IMPORTS}

VLLM_VERSION = "{version}"

# store_true, BooleanOptionalAction and store_const flags: never followed by a value.
NO_VALUE = frozenset(
    """
{words(table.no_value)}
    """.split()  # noqa: SIM905 (a word list reads better than 187 quoted strings)
)

# nargs="+" / "*" flags: every following non-flag token is theirs.
MULTI_VALUE = frozenset(
    """
{words(table.multi)}
    """.split()  # noqa: SIM905
)

# Every option string the parser knows: argparse reads any unique prefix of one as that one
# (allow_abbrev), and refuses any other flag (cachemgr/argprefix.py).
OPTIONS = frozenset(
    """
{words(table.options)}
    """.split()  # noqa: SIM905
)

# Short spellings of the flags cachemgr reads.
ALIASES = {{
{alias_lines}
}}

# The accepted values of the settings cachemgr reads, by argparse dest.
CHOICES = by_field(
    """
{choice_lines(table.choices)}
    """
)

# Dests vLLM parses with int() ("64.0" is refused); --max-model-len is not one: it takes 32k.
INTEGER = frozenset(
    """
{words(table.integer)}
    """.split()  # noqa: SIM905
)

# VLLM_KV_CACHE_LAYOUT's values (vllm/envs.py; case-sensitive, "" refused), in vLLM's order.
KV_LAYOUTS = tuple("{" ".join(layouts)}".split())  # noqa: SIM905

# Old layout name → the one vLLM reads it as (config/cache.py _LAYOUT_COMPAT_ALIASES).
KV_LAYOUT_ALIASES = {{
{layout_aliases}
}}

# vLLM's own --quantization methods (QuantizationMethods); a plugin may register more.
QUANTIZATION_METHODS = frozenset(
    """
{words(typing.get_args(QuantizationMethods))}
    """.split()  # noqa: SIM905
)

# vLLM's own --load-format values (model_loader's table); a plugin may register more.
LOAD_FORMATS = frozenset(
    """
{words(load_formats())}
    """.split()  # noqa: SIM905
)

# Those vLLM refuses without --allow-deprecated-quantization (ModelConfig).
DEPRECATED_QUANTIZATION = frozenset(
    """
{words(DEPRECATED_QUANTIZATION_METHODS)}
    """.split()  # noqa: SIM905
)

# Attention backends (AttentionBackendEnum, read upper-cased; a plugin registers as CUSTOM)
# and the KV cache spec kinds --attention-config's backend_per_kind is keyed by.
ATTENTION_BACKENDS = frozenset(
    """
{words([e.name for e in AttentionBackendEnum])}
    """.split()  # noqa: SIM905
)
KV_SPEC_KINDS = frozenset(
    """
{words([k.value for k in KVCacheSpecKind])}
    """.split()  # noqa: SIM905
)''')


if __name__ == "__main__":
    main()
