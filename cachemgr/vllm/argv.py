"""A vLLM launch command as vLLM's own parser sees it, without importing vLLM.

vLLM's `FlexibleArgumentParser.parse_args` (vllm/utils/argparse_utils.py, the same in 0.33.0
and 0.34.0) rewrites argv before argparse reads it; `prepass` does the rewrites that can
change what cachemgr reads, in vLLM's order:
1. `vllm serve … --model M …` → `vllm serve M …` (the positional `model_tag`);
2. `--config FILE.yaml` → its keys spliced in after the model, so the command line wins;
3. `--max_model_len` → `--max-model-len` (the flag name up to its first `.`), `-O3` →
   `--optimization-level 3`;
4. dotted keys (`--hf-overrides.rope_scaling.factor 4`,
   `--kv-transfer-config.kv_connector_extra_config.secondary_tiers '[…]'`) merged into one JSON
   value per flag, appended last (so it replaces an earlier plain JSON value of that flag).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachemgr.errors import ConfigError, NotFoundError
from cachemgr.launchenv import split_env

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_PYTHON = re.compile(r"python(\d+(\.\d+)*)?")
_NAME_PART = re.compile(r"(?<=--)[^.]*")  # vLLM's: from the first -- to the first .
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
ReadConfig = Callable[[str], dict[str, Any]]


@dataclass(frozen=True)
class VllmCommand:
    """A launch split where vLLM's parser starts: `prefix` runs the program (`env A=1 vllm`,
    `python -m vllm.entrypoints.openai.api_server`), `args` is what its parser gets."""

    prefix: tuple[str, ...]
    args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # VAR=value before the program

    @property
    def serve(self) -> bool:
        """`vllm serve` (a positional model) rather than the api_server module (`--model`)."""
        return self.args[:1] == ("serve",)

    @property
    def tokens(self) -> list[str]:
        return [*self.prefix, *self.args]


def split_vllm(tokens: Sequence[str]) -> VllmCommand | None:
    """The vLLM command in `tokens`, None if they do not launch vLLM."""
    tokens = list(tokens)
    env, i = split_env(tokens)
    if i >= len(tokens):
        return None
    program = os.path.basename(tokens[i])
    if program == "vllm" and tokens[i + 1 : i + 2] == ["serve"]:
        return VllmCommand(tuple(tokens[: i + 1]), tuple(tokens[i + 1 :]), env)
    if _PYTHON.fullmatch(program) and tokens[i + 1 : i + 3] == ["-m", API_SERVER_MODULE]:
        return VllmCommand(tuple(tokens[: i + 3]), tuple(tokens[i + 3 :]), env)
    return None


def read_yaml_config(path: str) -> dict[str, Any]:
    """A `--config` file as vLLM reads it (yaml.safe_load of a .yaml/.yml mapping)."""
    import yaml  # type: ignore[import-untyped]  # only a --config launch pays for it

    if path.rsplit(".", 1)[-1] not in ("yaml", "yml"):
        raise ConfigError(f"--config {path}: vLLM reads only .yaml/.yml config files")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:  # a missing file is "not found" (exit 1), as a missing model dir
        cls = NotFoundError if isinstance(e, FileNotFoundError) else ConfigError
        raise cls(f"--config {path}: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path} is not YAML: {str(e).splitlines()[0]}") from e
    except UnicodeDecodeError as e:  # (vLLM opens it as UTF-8 too, and fails the same way)
        raise ConfigError(f"--config {path} is not UTF-8 text: {e.reason} at byte {e.start}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path} is not a mapping of option names to values")
    return data


def config_args(data: dict[str, Any], no_value: frozenset[str]) -> list[str]:
    """A config file's keys as flags (load_config_file): true → `--key`, false → `--no-key`
    where vLLM has that flag, a list → its items, a dict → JSON."""
    out: list[str] = []
    for key, value in data.items():
        if isinstance(value, bool):
            if value:
                out.append(f"--{key}")
            elif dashes(f"--no-{key}") in no_value:
                out.append(f"--no-{key}")
        elif isinstance(value, list):
            if value:
                out += [f"--{key}", *map(str, value)]
        elif isinstance(value, dict):
            out += [f"--{key}", json.dumps(value)]
        else:
            out += [f"--{key}", str(value)]
    return out


def prepass(
    command: VllmCommand,
    no_value: frozenset[str],
    read_config: ReadConfig = read_yaml_config,
) -> list[str]:
    """`command.args` after vLLM's argv rewrites (module docstring), ready to be scanned."""
    args = list(command.args)
    if command.serve:
        args = _model_to_front(args)
    if "--config" in args:
        args = _splice_config(args, no_value, read_config)
    return _merge_dotted(_rename(args))


def _model_to_front(args: list[str]) -> list[str]:
    at = next((i for i, a in enumerate(args) if re.match(r"^--model(=.+|$)", a)), None)
    if at is None:
        return args
    if args[at] == "--model":
        if at + 1 >= len(args):
            raise ConfigError("--model needs a value")
        return ["serve", args[at + 1], *args[1:at], *args[at + 2 :]]
    return ["serve", args[at].removeprefix("--model="), *args[1:at], *args[at + 1 :]]


def _splice_config(args: list[str], no_value: frozenset[str], read: ReadConfig) -> list[str]:
    if args.count("--config") > 1:
        raise ConfigError("more than one --config file: vLLM takes one")
    at = args.index("--config")
    if at == len(args) - 1:
        raise ConfigError("--config needs a file")
    spliced = config_args(read(args[at + 1]), no_value)
    rest = args[:at] + args[at + 2 :]
    if not rest or rest[0].startswith("-"):  # the api_server module: no subcommand
        return spliced + rest
    # `serve`: after the positional model if the command line has one, else right after serve.
    # vLLM looks for that model right after `serve` *before* it takes --config out (so not in
    # `serve --config c.yaml M`), and without one there or a `model:` in the file it refuses.
    model_in_cli = len(args) > 1 and not args[1].startswith("-")
    if not model_in_cli and "--model" not in spliced:
        raise ConfigError(
            "no model: with --config, vLLM takes it right after `serve` or from the file's"
            " `model:` key"
        )
    keep = 2 if model_in_cli else 1
    return rest[:keep] + spliced + rest[keep:]


def dashes(name: str) -> str:
    """A flag name as vLLM reads it: `_` → `-` up to its first `.` (`--kv_transfer_config`)."""
    return _NAME_PART.sub(lambda m: m.group(0).replace("_", "-"), name, count=1)


def _rename(args: list[str]) -> list[str]:
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            key, eq, value = arg.partition("=")
            out.append(dashes(key) + eq + value)
        elif arg.startswith("-O") and arg != "-O":
            out += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
        elif arg == "-O" and args[i + 1 : i + 2] in (["0"], ["1"], ["2"], ["3"]):
            out.append("--optimization-level")
        else:
            out.append(arg)
    return out


def _merge_dotted(args: list[str]) -> list[str]:
    """Dotted keys become one JSON value per flag, appended last (lists are concatenated,
    dicts merged, anything else replaced, as vLLM's recursive_dict_update does)."""
    merged: dict[str, dict[str, Any]] = {}
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not (arg.startswith("-") and "." in arg.partition("=")[0]):
            out.append(arg)
            continue
        name, eq, raw = arg.partition("=")
        if not eq:
            if i >= len(args):
                raise ConfigError(f"{name} needs a value")
            raw = args[i]
            i += 1
        if name.endswith("+"):
            name, raw = name[:-1], json.dumps(raw.split(","))
        flag, *keys = name.split(".")
        value: Any = dotted_value(raw)
        for key in reversed(keys):
            value = {key: value}
        _update(merged.setdefault(flag, {}), value)
    for flag, value in merged.items():
        out += [flag, json.dumps(value)]
    return out


def dotted_value(raw: str) -> Any:
    """JSON, else a human-readable integer (`80g`), else the string itself."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        pass
    m = _HUMAN_INT.fullmatch(raw.strip())
    if m and m[2].islower():
        return int(float(m[1]) * {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}[m[2]])
    if m and m[1].isdigit():
        return int(m[1]) * {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m[2]]
    try:
        return int(raw)  # human_readable_int's last resort: "1_000" is 1000
    except ValueError:
        return raw


def _update(original: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(original.get(key), dict):
            _update(original[key], value)
        elif isinstance(value, list) and isinstance(original.get(key), list):
            original[key] += value
        else:
            original[key] = value
