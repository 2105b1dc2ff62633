"""Point a vLLM launch's fs tier at another `root_dir`, in the form the operator wrote it.

A plain `--kv-transfer-config '{…}'` (any spelling, `=` or not) gets its JSON rewritten; a
dotted key whose value holds the tier (`--kv-transfer-config.kv_connector_extra_config.
secondary_tiers '[…]'`) gets that value rewritten. A tier that only a `--config` YAML file
sets is overridden by one `--kv-transfer-config` appended to the command (the command line
wins over the file in vLLM), leaving the file alone. The result is read back with the same
parser and must name the new root_dir, or nothing runs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from cachemgr.argprefix import read_option
from cachemgr.errors import ConfigError
from cachemgr.vllm.argcheck import config_json
from cachemgr.vllm.args import ENGINE, resolve_vllm_args
from cachemgr.vllm.argv import ReadConfig, dashes, dotted_value, read_yaml_config, split_vllm
from cachemgr.vllm.flags import OPTIONS
from cachemgr.vllm.tier import with_root_dir

FLAG = "--kv-transfer-config"
# What `cachemgr init --env-file/--print-env` names the namespace dir for a vLLM launch: a
# wrapper script puts it into the fs tier's root_dir (vLLM reads no such variable itself).
ROOT_DIR_ENV = "CACHEMGR_VLLM_ROOT_DIR"
# …and the launch's whole --kv-transfer-config with that root_dir, for a server command that
# passes it as is: `vllm serve … --kv-transfer-config "$CACHEMGR_VLLM_KV_TRANSFER_CONFIG"`.
KV_CONFIG_ENV = "CACHEMGR_VLLM_KV_TRANSFER_CONFIG"


def point_root_dir(
    command: Sequence[str],
    root_dir: str,
    environ: dict[str, str] | None = None,
    read_config: ReadConfig = read_yaml_config,
) -> list[str]:
    """`command` with its fs tier's root_dir set to `root_dir`; ConfigError if it has none."""
    cmd = split_vllm(command)
    if cmd is None or resolve_vllm_args(command, environ, read_config).tier is None:
        raise ConfigError(f"the launch has no fs tier in {FLAG}: nothing to point at {root_dir}")
    args = list(cmd.args)
    i = 0
    while i < len(args):
        key, eq, inline = args[i].partition("=")
        name = _flag_name(key)
        if name != FLAG and not name.startswith(FLAG + "."):
            i += 1
            continue
        at = i if eq else i + 1  # where its value is
        if at < len(args):
            new = _rewritten(name, inline if eq else args[at], root_dir)
            if new is not None:
                args[at] = f"{key}={new}" if eq else new
        i = at + 1
    out = [*cmd.prefix, *args]
    if _root_of(out, environ, read_config) != root_dir:  # set only in the --config file
        out += [FLAG, pointed_config(out, root_dir, environ, read_config)]
    if _root_of(out, environ, read_config) != root_dir:
        raise ConfigError(f"cannot point the launch's fs tier at {root_dir}: change it by hand")
    return out


def pointed_config(
    command: Sequence[str],
    root_dir: str,
    environ: dict[str, str] | None = None,
    read_config: ReadConfig = read_yaml_config,
) -> str:
    """The launch's effective --kv-transfer-config as JSON, its fs tier at `root_dir`."""
    raw = resolve_vllm_args(command, environ, read_config).kv_transfer_config or "{}"
    config, _ = with_root_dir(json.loads(raw), root_dir)
    return json.dumps(config, separators=(",", ":"))


def _flag_name(key: str) -> str:
    """A token's flag as vLLM reads it, dotted keys kept (`--kv-transfer-conf.x` is
    `--kv-transfer-config.x`: a unique prefix); a value as it is. The launch was read whole
    before, so every flag here is one vLLM knows."""
    if not key.startswith("--") or key == "--":
        return key
    flag, dot, rest = dashes(key).partition(".")
    option = read_option(flag, OPTIONS, ENGINE)
    return (option.name if option else flag) + dot + rest


def _rewritten(name: str, raw: str, root_dir: str) -> str | None:
    """The value with its fs tiers pointed at root_dir, None if it holds no fs tier."""
    if name == FLAG:
        try:
            value = config_json(raw)
        except (ValueError, RecursionError):
            return None
    else:
        if name.endswith("+"):
            return None  # `key+ a,b` appends strings: it cannot hold a tier object
        value = dotted_value(raw)
    new, hit = with_root_dir(value, root_dir)
    return json.dumps(new) if hit else None


def _root_of(
    command: Sequence[str], environ: dict[str, str] | None, read_config: ReadConfig
) -> str | None:
    tier = resolve_vllm_args(command, environ, read_config).tier
    return tier.root_dir if tier else None
