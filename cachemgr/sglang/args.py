"""Read the settings that matter to the cache out of an SGLang launch command.

Operators already have a command line (`sglang serve …`, `python -m sglang.launch_server …`);
cachemgr reads the same tokens instead of asking for the values again, as SGLang's parser reads
them (unique prefixes included). Only the flags below are kept; every other flag SGLang knows is
skipped, and one it does not know is refused, as SGLang refuses it.
"""

from __future__ import annotations

import json
import os
import shlex
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cachemgr.argprefix import read_option
from cachemgr.errors import ConfigError
from cachemgr.launchenv import split_env
from cachemgr.sglang.argcheck import check_types, check_values
from cachemgr.sglang.flags import MULTI_VALUE, NO_VALUE, OPTIONS, SGLANG_VERSION


class LaunchArgs(BaseModel):
    """What an SGLang server will run with, SGLang's defaults filled in where a flag is absent.

    Defaults come from SGLang 0.5.23's sglang/srt/arg_groups/fields/<file>.py, named per field.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    # fields/model.py
    model_path: str = Field(min_length=1)
    revision: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"
    trust_remote_code: bool = False
    # model_loader/utils.py `get_model_architecture`: transformers and mindspore pick their
    # backend's class over the registry's (see kvscales.check_scales_loadable).
    model_impl: str = "auto"
    json_model_override_args: str = "{}"
    # The loader hands it huggingface_hub as cache_dir (model_loader/loader.py
    # `_prepare_weights`): a repo id's weights come from there, not from HF_HUB_CACHE.
    download_dir: str | None = None
    # JSON of FP8 KV scaling factors, loaded when kv_cache_dtype is fp8_e4m3
    # (model_runner_components/load_model_utils.py `load_kv_cache_scales`).
    quantization_param_path: str | None = None
    # fields/serving.py; serving_hook.py resolves an absent served name to the model path.
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    # fields/spec.py
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_draft_model_revision: str | None = None
    speculative_draft_model_quantization: str | None = None  # None: inherits quantization
    speculative_draft_kv_cache_dtype: str | None = None  # None: follows kv_cache_dtype
    speculative_draft_load_format: str | None = None  # None: the target's, as resolved
    # fields/schedule.py has page_size=None; overrides.py `_page_size_default` resolves None to
    # 1 on CUDA/ROCm (64 on MUSA) — the default that makes the L3 file cache write-only. But
    # the default attention backend (trtllm_mha on SM100) and model overrides can raise it, so
    # without the flag only the server knows: see `resolved_page_size`.
    page_size: int = Field(1, ge=1)
    # flag: --page-size given; attention_backend: forced by an explicit backend (overrides.py
    # `_mla_backend_page_constraints`); default: not given, SGLang resolves it on the GPU.
    page_size_source: Literal["flag", "attention_backend", "default"] = "default"
    # fields/exec_.py, fields/spec.py
    attention_backend: str | None = None
    decode_attention_backend: str | None = None
    prefill_attention_backend: str | None = None
    speculative_draft_attention_backend: str | None = None
    # fields/parallel.py
    tp_size: int = Field(1, ge=1)
    pp_size: int = Field(1, ge=1)
    dp_size: int = Field(1, ge=1)
    attn_dp_size: int = Field(1, ge=1)
    attn_cp_size: int = Field(1, ge=1)
    dcp_size: int = Field(1, ge=1)
    enable_dp_attention: bool = False  # deprecated spelling of attn_dp_size=dp_size
    # Not in the identity itself: above 1 it becomes attn_dp_size (see _apply_dwdp); SGLang
    # ignores any value up to 1, so there is no lower bound.
    dwdp_size: int = 1
    # fields/exec_.py: both refused with a DWDP group (parallel_hook.py `handle_dwdp`)
    enable_eplb: bool = False
    enable_two_batch_overlap: bool = False
    # fields/memory.py
    enable_hierarchical_cache: bool = False
    hicache_mem_layout: str = "page_first"
    hicache_io_backend: str = "kernel"
    hicache_storage_backend: str | None = None
    hicache_storage_backend_extra_config: str | None = None
    # fields/serving.py: the extra config's file_storage_path when it has none (hierarchical
    # cache only: unified_radix_cache.py; the PD decode offload path does not read it)
    file_storage_path: str | None = None
    enable_page_major_kv_layout: bool = False  # kv_cache_configurator.py PageMajor* pools
    enable_unified_memory: bool = False  # implies the page-major layout
    # fields/memory.py, fields/dllm: caches that replace the radix cache HiCache extends
    # (mem_cache/registry.py), and diffusion LLMs, whose hook turns hierarchical cache off
    enable_lmcache: bool = False
    enable_flexkv: bool = False
    radix_cache_backend: str | None = None
    dllm_algorithm: str | None = None
    # fields/disagg.py: a PD decode server with offloading writes through the storage backend
    # without --enable-hierarchical-cache (managers/scheduler.py DecodeKVCacheOffloadManager).
    disaggregation_mode: str = "null"
    disaggregation_decode_enable_offload_kvcache: bool = False
    # fields/exec_.py
    mamba_ssm_dtype: str | None = None
    mamba_track_interval: int = Field(256, ge=1)
    # Not a flag: the `VAR=value` assignments in front of the program (`env HF_HOME=… sglang
    # serve …`), which the server's environment has on top of the one it is started from.
    launch_env: dict[str, str] = Field(default_factory=dict)

    @property
    def resolved_page_size(self) -> int | None:
        """The page size the server will use, or None when SGLang decides it on the GPU."""
        return None if self.page_size_source == "default" else self.page_size

    @property
    def extra_config(self) -> dict[str, Any]:
        """--hicache-storage-backend-extra-config as the storage backend gets it: parsed
        (parse_extra_config), with --file-storage-path as its file_storage_path by default."""
        extra = parse_extra_config(self.hicache_storage_backend_extra_config)
        if self.file_storage_path and self.enable_hierarchical_cache:
            extra.setdefault("file_storage_path", self.file_storage_path)
        return extra

    @property
    def model_name(self) -> str:
        """The name SGLang puts into page file names: the served name, else the model path."""
        return self.served_model_name or self.model_path


# Flag spellings (aliases included, from SGLang's Arg(aliases=...)) → LaunchArgs field.
FLAGS: dict[str, str] = {
    "--model-path": "model_path",
    "--model": "model_path",
    "--revision": "revision",
    "--dtype": "dtype",
    "--quantization": "quantization",
    "--kv-cache-dtype": "kv_cache_dtype",
    "--load-format": "load_format",
    "--trust-remote-code": "trust_remote_code",
    "--model-impl": "model_impl",
    "--json-model-override-args": "json_model_override_args",
    "--download-dir": "download_dir",
    "--quantization-param-path": "quantization_param_path",
    "--enable-page-major-kv-layout": "enable_page_major_kv_layout",
    "--enable-unified-memory": "enable_unified_memory",
    "--served-model-name": "served_model_name",
    "--host": "host",
    "--port": "port",
    "--speculative-algorithm": "speculative_algorithm",
    "--speculative-draft-model-path": "speculative_draft_model_path",
    "--speculative-draft-model": "speculative_draft_model_path",
    "--speculative-draft-model-revision": "speculative_draft_model_revision",
    "--speculative-draft-model-quantization": "speculative_draft_model_quantization",
    "--speculative-draft-kv-cache-dtype": "speculative_draft_kv_cache_dtype",
    "--speculative-draft-load-format": "speculative_draft_load_format",
    "--page-size": "page_size",
    "--attention-backend": "attention_backend",
    "--decode-attention-backend": "decode_attention_backend",
    "--prefill-attention-backend": "prefill_attention_backend",
    "--speculative-draft-attention-backend": "speculative_draft_attention_backend",
    "--tp-size": "tp_size",
    "--tensor-parallel-size": "tp_size",
    "--pp-size": "pp_size",
    "--pipeline-parallel-size": "pp_size",
    "--dp-size": "dp_size",
    "--data-parallel-size": "dp_size",
    "--attn-dp-size": "attn_dp_size",
    "--attention-data-parallel-size": "attn_dp_size",
    "--attn-cp-size": "attn_cp_size",
    "--attention-context-parallel-size": "attn_cp_size",
    "--dcp-size": "dcp_size",
    "--decode-context-parallel-size": "dcp_size",
    "--enable-dp-attention": "enable_dp_attention",
    "--dwdp-size": "dwdp_size",
    "--enable-eplb": "enable_eplb",
    "--enable-two-batch-overlap": "enable_two_batch_overlap",
    "--enable-hierarchical-cache": "enable_hierarchical_cache",
    "--enable-hicache": "enable_hierarchical_cache",
    "--hicache-mem-layout": "hicache_mem_layout",
    "--hicache-io-backend": "hicache_io_backend",
    "--hicache-storage-backend": "hicache_storage_backend",
    "--hicache-storage-backend-extra-config": "hicache_storage_backend_extra_config",
    "--file-storage-path": "file_storage_path",
    "--enable-lmcache": "enable_lmcache",
    "--enable-flexkv": "enable_flexkv",
    "--radix-cache-backend": "radix_cache_backend",
    "--dllm-algorithm": "dllm_algorithm",
    "--disaggregation-mode": "disaggregation_mode",
    "--disaggregation-decode-enable-offload-kvcache": (
        "disaggregation_decode_enable_offload_kvcache"
    ),
    "--mamba-ssm-dtype": "mamba_ssm_dtype",
    "--mamba-track-interval": "mamba_track_interval",
}
_FLAG_OF = {field: flag for flag, field in reversed(FLAGS.items())}
ENGINE = f"SGLang {SGLANG_VERSION}"


def split_command(command: str | Sequence[str]) -> list[str]:
    """A launch command as tokens; a single string is split like a POSIX shell would."""
    if isinstance(command, str):
        # A pasted multi-line command keeps its `\<newline>` continuations; shlex would turn
        # each into a "\n" token.
        return shlex.split(command.replace("\\\n", " "))
    return list(command)


def scan_flags(tokens: Sequence[str]) -> dict[str, str | bool]:
    """The known flags of a command and their raw values; the last occurrence wins (as argparse).

    The program is `sglang serve` (whose first word may be the model), else whatever precedes
    the first `--flag` (`python -m sglang.launch_server`, `env VAR=1 …`). Each token is read
    as SGLang's argparse reads it: a unique prefix is its flag; an ambiguous prefix, a flag
    SGLang lacks, or a word no flag takes (SGLang has no positionals) is a ConfigError.
    """
    found: dict[str, str | bool] = {}
    args = _parser_args(tokens)
    i = 0
    while i < len(args):
        option = None if args[i] == "--" else read_option(args[i], OPTIONS, ENGINE)
        i += 1
        if option is None:
            raise ConfigError(
                f"unrecognized argument {args[i - 1]!r}: {ENGINE} refuses it (no flag takes it)"
            )
        if option.name == "--config":
            raise ConfigError(
                "the launch command uses --config: cachemgr cannot read SGLang config files; "
                "pass the flags on the command line instead"
            )
        value: str | bool = True
        if option.explicit is not None:
            value = option.explicit
        elif option.name not in NO_VALUE and i < len(args) and _is_value(args[i]):
            value = args[i]
            i += 1
            while option.name in MULTI_VALUE and i < len(args) and _is_value(args[i]):
                i += 1  # `--cuda-graph-bs 64 128 …`: the rest of the run is its own
        if option.name in FLAGS:
            found[FLAGS[option.name]] = value
    return found


def _parser_args(tokens: Sequence[str]) -> list[str]:
    """What SGLang's parser gets: after `sglang serve` (cli/serve.py takes `--model-type` out,
    then reads a first word as `--model-path`), else from the first `--flag` on."""
    _, at = split_env(tokens)
    program = list(tokens[at : at + 2])
    if len(program) == 2 and os.path.basename(program[0]) == "sglang" and program[1] == "serve":
        args = _without_model_type(tokens[at + 2 :])
        return ["--model-path", *args] if args and not args[0].startswith("-") else args
    start = next((n for n, tok in enumerate(tokens) if tok.startswith("--")), len(tokens))
    _refuse_vllm(tokens[at:start])
    return _without_model_type(tokens[start:])


def _refuse_vllm(program: Sequence[str]) -> None:
    """A vLLM launch behind a wrapper (`nice vllm serve`, `bash -c "vllm serve …"`) is no
    SGLang launch: read as SGLang's flags (`--model`, `--kv-cache-dtype` are both), it would
    get an SGLang namespace and its tier's root_dir would not be the namespace's."""
    for token in program:
        words = token.split()
        if any(os.path.basename(w) == "vllm" or w.startswith("vllm.") for w in words[:3]):
            raise ConfigError(
                f"the launch runs vLLM behind {program[0]!r}: cachemgr reads a vLLM launch "
                "that starts with `vllm serve` or `python -m vllm.entrypoints.openai.api_server` "
                "(after `env VAR=…`); put the wrapper in front of cachemgr instead"
            )


def _is_value(token: str) -> bool:
    return read_option(token, OPTIONS, ENGINE) is None


def _without_model_type(args: Sequence[str]) -> list[str]:
    """`sglang serve` takes `--model-type` (exactly that spelling) out before its parser runs
    (cli/serve.py `_extract_model_type_override`)."""
    out: list[str] = []
    i = 0
    while i < len(args):
        if args[i] == "--model-type":
            i += 2
            continue
        if not args[i].startswith("--model-type="):
            out.append(args[i])
        i += 1
    return out


def resolve_launch_args(
    command: str | Sequence[str] = (), overrides: Mapping[str, Any] | None = None
) -> LaunchArgs:
    """LaunchArgs from a launch command, then explicit values (None = not given) on top."""
    tokens = split_command(command)
    values: dict[str, Any] = dict(scan_flags(tokens))
    check_types(values, _FLAG_OF)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    check_values(values, _FLAG_OF)
    if not values.get("model_path"):
        raise ConfigError(
            "no model path: pass --model-path or an SGLang launch command after `--` "
            "(e.g. `-- sglang serve --model-path <dir or repo id> …`)"
        )
    values.pop("page_size_source", None)  # derived below, never given
    values["launch_env"] = split_env(tokens)[0]
    values = _apply_sglang_resolutions(values)
    parse_extra_config(values.get("hicache_storage_backend_extra_config"))  # refused here, once
    try:
        return LaunchArgs(**values)
    except ValidationError as e:
        first = e.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "?"
        flag = _FLAG_OF.get(field, field)
        raise ConfigError(f"invalid {flag} {first.get('input')!r}: {first['msg']}") from None


def parse_extra_config(raw: str | None) -> dict[str, Any]:
    """--hicache-storage-backend-extra-config as the object SGLang reads, {} if absent: JSON,
    or `@path` to a .json, .toml or .yaml file (its cache controller's
    `parse_storage_backend_extra_config`). Anything else is a ConfigError: SGLang would fail on
    it at start, and a value read as {} would hide its file_storage_path and max_size."""
    if not raw:
        return {}
    if raw.startswith("@"):
        data = _extra_config_file(raw[1:])
    else:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            data = None
    if not isinstance(data, dict):
        raise ConfigError(
            f"--hicache-storage-backend-extra-config is not a JSON object: {raw!r:.80}"
        )
    return data


def _yaml(text: str) -> Any:
    import yaml  # type: ignore[import-untyped]  # only an @file.yaml launch pays for it

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(str(e)) from None


_EXTRA_READERS: dict[str, Callable[[str], Any]] = {
    ".json": json.loads,
    ".toml": tomllib.loads,
    ".yaml": _yaml,
    ".yml": _yaml,
}


def _extra_config_file(path: str) -> Any:
    """The content of an `@path` extra config, read by its extension as SGLang reads it."""
    flag = f"--hicache-storage-backend-extra-config @{path}"
    read = _EXTRA_READERS.get(os.path.splitext(path)[1].lower())
    if read is None:
        raise ConfigError(f"{flag}: SGLang reads a .json, .toml, .yaml or .yml file only")
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{flag}: {getattr(e, 'strerror', None) or e}") from None
    try:
        return read(text)
    except (ValueError, RecursionError):
        raise ConfigError(f"{flag}: not a valid {os.path.splitext(path)[1][1:]} file") from None


def _apply_sglang_resolutions(values: dict[str, Any]) -> dict[str, Any]:
    """The rewrites SGLang applies to these flags before it builds its caches."""
    out = dict(values)
    # parallel_hook.py `_handle_deprecated_dp_attention`: `--dp-size N --enable-dp-attention`
    # means N attention-DP groups and one replica.
    if out.get("enable_dp_attention") and int(out.get("attn_dp_size", 1)) == 1:
        out["attn_dp_size"], out["dp_size"] = out.get("dp_size", 1), 1
    _apply_dwdp(out)
    # hicache_hook.py `handle_hicache`, for a server that writes pages (hierarchical cache, or
    # a PD decode server offloading through the backend: its host pool takes the same layout):
    # `resolve_layout_io_compatibility` makes page_first with direct I/O page_first_direct,
    # then `resolve_unified_memory_layout_io` makes that page_first again under unified memory.
    if out.get("enable_hierarchical_cache") or out.get(
        "disaggregation_decode_enable_offload_kvcache"
    ):
        layout = out.get("hicache_mem_layout", "page_first")
        if layout == "page_first" and out.get("hicache_io_backend") == "direct":
            layout = "page_first_direct"
        if layout == "page_first_direct" and out.get("enable_unified_memory"):
            layout = "page_first"
        out["hicache_mem_layout"] = layout
    # serving_hook.py: an unset draft quantization inherits the target's, then `unquant` is
    # the explicit spelling of "no quantization" for either.
    if out.get("speculative_draft_model_quantization") is None:
        out["speculative_draft_model_quantization"] = out.get("quantization")
    for key in ("quantization", "speculative_draft_model_quantization"):
        if out.get(key) == "unquant":
            out[key] = None
    # fields/model.py: nullable_str reads an empty path or "None" as no scales file.
    if out.get("quantization_param_path") in ("", "None"):
        out["quantization_param_path"] = None
    _apply_backend_aliases(out)
    out["page_size_source"] = "flag" if out.get("page_size") is not None else "default"
    forced = _backend_page_size(out, _int_or_none(out.get("page_size")))
    if forced is not None:
        out["page_size"], out["page_size_source"] = forced, "attention_backend"
    return out


def _apply_dwdp(values: dict[str, Any]) -> None:
    """parallel_hook.py `handle_dwdp` (after the deprecated DP-attention spelling): a DWDP
    group makes every TP rank its own attention-DP group, so a rank's pages hold all KV heads
    and are keyed as attention-TP rank 0 of 1 (cache_controller.py
    `_generate_storage_config`): the topology of `--attn-dp-size <tp>`. Its assertions
    refuse at start, in this order, what is refused here, before init purges anything."""
    dwdp = _int_or_none(values.get("dwdp_size"))
    if dwdp is None or dwdp <= 1:
        return
    tp = _int_or_none(values.get("tp_size", 1))
    refusals = (
        (dwdp != tp, f"set --tp-size {dwdp} (equal to --dwdp-size) or drop --dwdp-size"),
        (
            values.get("disaggregation_mode", "null") not in ("null", "prefill"),
            "use --disaggregation-mode null or prefill, or drop --dwdp-size",
        ),
        (bool(values.get("enable_eplb")), "drop --enable-eplb or --dwdp-size"),
        (
            values.get("speculative_algorithm") is not None,
            "drop --speculative-algorithm or --dwdp-size",
        ),
        (_int_or_none(values.get("pp_size", 1)) != 1, "use --pp-size 1 or drop --dwdp-size"),
        (
            bool(values.get("enable_two_batch_overlap")),
            "drop --enable-two-batch-overlap or --dwdp-size",
        ),
    )
    for refused, change in refusals:
        if refused:
            raise ConfigError(f"--dwdp-size {dwdp}: SGLang {SGLANG_VERSION} refuses it; {change}")
    values["attn_dp_size"], values["dp_size"] = dwdp, 1


# serving_hook.py `handle_deprecated_args`: deprecated attention-backend names, renamed before
# any backend's page size (overrides.py `_mla_backend_page_constraints`) is applied.
BACKEND_ALIASES = {"compressed": "dsv4", "tokenspeed_mla": "cutedsl_mla"}
BACKEND_FIELDS = (
    "attention_backend",
    "decode_attention_backend",
    "prefill_attention_backend",
    "speculative_draft_attention_backend",
)


def _apply_backend_aliases(values: dict[str, Any]) -> None:
    """The deprecated backend names as SGLang renames them, with the FP8 KV cache tokenspeed_mla
    implied: pages stored as fp8_e4m3 whatever --kv-cache-dtype says."""
    renamed = {
        f: BACKEND_ALIASES[v] for f in BACKEND_FIELDS if (v := values.get(f)) in BACKEND_ALIASES
    }
    if renamed.get("prefill_attention_backend") == "cutedsl_mla":
        renamed["prefill_attention_backend"] = "trtllm_mla"  # cutedsl_mla is decode-only
    if "tokenspeed_mla" in (
        values.get("attention_backend"),
        values.get("decode_attention_backend"),
    ):
        renamed["kv_cache_dtype"] = "fp8_e4m3"
    values.update(renamed)


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None  # LaunchArgs reports the bad value


def _backend_page_size(values: Mapping[str, Any], page: int | None) -> int | None:
    """The page size an explicit attention backend forces (overrides.py
    `_mla_backend_page_constraints`, applied after model overrides), None if it forces none."""
    main = {values.get("attention_backend"), values.get("decode_attention_backend")}
    every = main | {values.get("prefill_attention_backend")}
    new = page
    if "flashmla" in main:
        new = 64
    if "trtllm_mla" in main and new not in (32, 64):
        new = 64
    if "cutedsl_mla" in every and new not in (32, 64):
        new = 64
    mha = every | {values.get("speculative_draft_attention_backend")}
    if "trtllm_mha" in mha and new not in (16, 32, 64, 128):
        new = 64
    if "hpc_ops" in every and new != 64:
        new = 64
    return new if new != page else None
