"""vLLM as cachemgr sees it: its fs KV tier, whose root_dir is in the launch command."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cachemgr.doctor.finding import Finding
from cachemgr.engine import Engine, Installed
from cachemgr.errors import CachemgrError, ConfigError
from cachemgr.gc.policy import GcPolicy
from cachemgr.identity import model_dir
from cachemgr.identity.digest_cache import DigestCache
from cachemgr.identity.fingerprint import IdentityOptions, ProgressFactory
from cachemgr.identity.record import Digested
from cachemgr.layout import Layout
from cachemgr.vllm import lint, values
from cachemgr.vllm.args import VllmLaunchArgs, is_vllm_launch, resolve_vllm_args
from cachemgr.vllm.fstier import VLLM_FS_TIER
from cachemgr.vllm.identity import (
    VllmIdentity,
    compute_vllm_identity,
    installed_vllm_version,
    model_hub,
)
from cachemgr.vllm.rewrite import KV_CONFIG_ENV, ROOT_DIR_ENV, point_root_dir, pointed_config


class VllmEngine(Engine[VllmLaunchArgs]):
    """vLLM's fs tier (kv_offload secondary tier): cachemgr rewrites its root_dir."""

    name = "vllm"
    label = "vLLM"
    distribution = "vllm"
    version_example = "0.34.0"
    format = VLLM_FS_TIER
    record = VllmIdentity
    server_env_vars = (ROOT_DIR_ENV, KV_CONFIG_ENV)

    def claims(self, command: Sequence[str]) -> bool:
        return is_vllm_launch(command)

    def launch_args(
        self, command: Sequence[str], overrides: Mapping[str, Any], environ: Mapping[str, str]
    ) -> VllmLaunchArgs:
        """The launch command's settings (the server's environment included); it says all."""
        given = sorted(k for k, v in overrides.items() if v is not None)
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ConfigError(f"{flag} is an SGLang option: put vLLM's in its command")
        return resolve_vllm_args(command, dict(environ))

    def check_launch(
        self,
        args: VllmLaunchArgs,
        command: Sequence[str],
        environ: Mapping[str, str],
        *,
        plugin_values: frozenset[str],
    ) -> None:
        """A vLLM launch must have an fs tier cachemgr can point at its namespace dir, and
        values vLLM ships or a plugin registers (`plugin_values`)."""
        values.check_shipped(
            args.quantization,
            args.load_format,
            plugin_values,
            lambda: _declared_quantization(args, environ),
        )
        if args.tier is None:
            raise ConfigError(
                "the vLLM launch has no fs tier: add --kv-transfer-config with "
                'kv_connector_extra_config.secondary_tiers [{"type": "fs", "root_dir": …}] '
                "(docs/vllm.md); cachemgr would have nothing to manage"
            )
        point_root_dir(command, "/cachemgr-check", dict(environ))  # refuses before init

    def installed_version(self) -> str | None:
        return installed_vllm_version()

    def compute_identity(
        self,
        args: VllmLaunchArgs,
        options: IdentityOptions,
        *,
        cache: DigestCache | None,
        progress: ProgressFactory | None,
        installed: Installed,
    ) -> Digested:
        return compute_vllm_identity(
            args, options, cache=cache, progress=progress, installed=installed
        )

    def server_env(
        self, command: Sequence[str], storage_dir: Path, environ: Mapping[str, str]
    ) -> dict[str, str]:
        """The namespace dir, and the launch's --kv-transfer-config pointed at it (docs/vllm.md)."""
        config = pointed_config(command, str(storage_dir), dict(environ))
        return {ROOT_DIR_ENV: str(storage_dir), KV_CONFIG_ENV: config}

    def server_launch(
        self, command: Sequence[str], storage_dir: Path, environ: Mapping[str, str]
    ) -> tuple[list[str], dict[str, str]]:
        return point_root_dir(command, str(storage_dir), dict(environ)), dict(environ)

    def rewritten_command(
        self, command: Sequence[str], storage_dir: Path, environ: Mapping[str, str]
    ) -> list[str] | None:
        """The launch with its fs tier's root_dir set to the namespace dir."""
        return point_root_dir(command, str(storage_dir), dict(environ))

    def init_warnings(
        self,
        args: VllmLaunchArgs,
        storage_dir: Path,
        *,
        layout: Layout,
        environ: Mapping[str, str],
        hands_env: bool,
    ) -> list[str]:
        root = args.tier.root_dir if args.tier else None
        if hands_env or root is None or os.path.abspath(root).rstrip("/") == str(storage_dir):
            return []
        return [
            f"the launch's fs tier root_dir is {root}, not the namespace dir: start the server "
            'with `cachemgr exec -- <launch>`, or with --json\'s "command"',
        ]

    def exec_warnings(
        self,
        args: VllmLaunchArgs,
        storage_dir: Path,
        *,
        layout: Layout,
        environ: Mapping[str, str],
    ) -> list[str]:
        # (no root_dir warning: exec rewrites the one place vLLM reads the dir from)
        return []

    def lint(
        self,
        command: Sequence[str],
        *,
        layout: Layout,
        policy: GcPolicy,
        identity: Callable[[], Digested | None],
        environ: Mapping[str, str],
    ) -> list[Finding]:
        # either cap bounds the launch's namespace, so its tier does not fill the disk
        cap = policy.max_bytes if policy.max_bytes is not None else policy.namespace_max_bytes
        return lint.lint(
            resolve_vllm_args(command, dict(environ)),
            layout=layout,
            cap_bytes=cap,
            identity=identity,
            command=command,
        )


VLLM = VllmEngine()


def _declared_quantization(args: VllmLaunchArgs, environ: Mapping[str, str]) -> str | None:
    """The quantization method the checkpoint vLLM reads its config from (--hf-config-path, else
    the model) declares (`declared_quantization`); None for a model not found here (the
    identity refuses it in its own words)."""
    hub = model_hub(args, {**environ, **args.launch_env})
    try:
        directory = model_dir.locate_model(args.hf_config_path or args.model, args.revision, hub)
    except CachemgrError:
        return None
    return declared_quantization(directory)


def declared_quantization(directory: Path) -> str | None:
    """The method the checkpoint in `directory` declares in the quantization config vLLM
    matches --quantization against, lowercased ("" when it names none); None without one.
    The config is config.json's quantization_config, else an hf_quant_config.json beside it
    (transformers_utils/config.py), else its compression_config, each also of its text_config
    (model_arch_config_convertor.py). An unreadable config is no declaration: the identity then
    says what is wrong with it."""
    try:
        config = model_dir.read_json(directory / "config.json")
        legacy = model_dir.read_json(directory / "hf_quant_config.json")
    except CachemgrError:
        return None
    for cfg, beside in ((config, legacy), (config.get("text_config"), {})):
        if not isinstance(cfg, dict):
            continue
        declared = cfg.get("quantization_config") or beside or cfg.get("compression_config")
        if isinstance(declared, dict) and declared:
            return str(declared.get("quant_method", "")).lower()
    return None
