"""SGLang as cachemgr sees it: HiCacheFile pages in the dir its environment variable names."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cachemgr.doctor.finding import Finding
from cachemgr.engine import Engine, IdentityFlag, Installed, Probe, ProbeHooks
from cachemgr.errors import ConfigError
from cachemgr.gc.policy import GcPolicy
from cachemgr.identity.digest_cache import DigestCache
from cachemgr.identity.fingerprint import IdentityOptions, ProgressFactory
from cachemgr.identity.record import Digested
from cachemgr.launchenv import server_environ, split_env
from cachemgr.layout import Layout
from cachemgr.settings import Settings
from cachemgr.sglang import lint
from cachemgr.sglang.args import LaunchArgs, resolve_launch_args
from cachemgr.sglang.hicache import HICACHE_FILE, STORAGE_DIR_ENV
from cachemgr.sglang.identity import compute_identity, installed_sglang_version
from cachemgr.sglang.kvscales import unread_scales_warning
from cachemgr.sglang.probe import METRICS as PROBE_METRICS
from cachemgr.sglang.probe import ProbeLoop
from cachemgr.sglang.record import Identity
from cachemgr.sglang.storagedir import (
    StorageDirConflict,
    foreign_storage_env,
    storage_dir_conflicts,
)

# Named as SGLang names them where it is short.
_FLAGS = (
    IdentityFlag("--model-path", "model_path", str, "Model directory or Hugging Face repo id."),
    IdentityFlag("--revision", "revision", str, "Model revision (HF cache snapshots)."),
    IdentityFlag(
        "--served-model-name", "served_model_name", str, "Name SGLang puts in page file names."
    ),
    IdentityFlag(
        "--kv-cache-dtype", "kv_cache_dtype", str, "KV cache dtype (auto, bf16, fp8_e4m3, …)."
    ),
    IdentityFlag(
        "--page-size", "page_size", int, "Tokens per page (absent: SGLang resolves it on the GPU)."
    ),
    IdentityFlag("--dtype", "dtype", str, "Model dtype (auto: from config.json)."),
    IdentityFlag("--quantization", "quantization", str, "Load-time quantization method."),
    IdentityFlag("--tp-size", "tp_size", int, "Tensor parallel size."),
    IdentityFlag("--pp-size", "pp_size", int, "Pipeline parallel size."),
    IdentityFlag("--attn-dp-size", "attn_dp_size", int, "Attention data parallel size."),
    IdentityFlag("--attn-cp-size", "attn_cp_size", int, "Attention context parallel size."),
    IdentityFlag("--dcp-size", "dcp_size", int, "Decode context parallel size."),
    IdentityFlag(
        "--draft-model-path", "speculative_draft_model_path", str, "Speculative draft model."
    ),
    IdentityFlag(
        "--draft-model-revision", "speculative_draft_model_revision", str, "Draft revision."
    ),
    IdentityFlag(
        "--draft-quantization",
        "speculative_draft_model_quantization",
        str,
        "Draft quantization.",
    ),
    IdentityFlag(
        "--draft-kv-cache-dtype", "speculative_draft_kv_cache_dtype", str, "Draft KV dtype."
    ),
    IdentityFlag("--mamba-ssm-dtype", "mamba_ssm_dtype", str, "Mamba SSM state dtype."),
    IdentityFlag("--hicache-mem-layout", "hicache_mem_layout", str, "HiCache memory layout."),
)


class SGLangEngine(Engine[LaunchArgs]):
    """SGLang's HiCacheFile L3 backend: the server reads its dir from STORAGE_DIR_ENV."""

    name = "sglang"
    label = "SGLang"
    distribution = "sglang"
    version_example = "0.5.23"
    format = HICACHE_FILE
    record = Identity
    server_env_vars = (STORAGE_DIR_ENV,)
    identity_flags = _FLAGS
    probe_metrics = PROBE_METRICS

    def claims(self, command: Sequence[str]) -> bool:
        """Any launch: SGLang's parser reads a bare option list too, so it is the fallback
        the registry asks last."""
        return True

    def launch_args(
        self, command: Sequence[str], overrides: Mapping[str, Any], environ: Mapping[str, str]
    ) -> LaunchArgs:
        return resolve_launch_args(command, overrides)

    def installed_version(self) -> str | None:
        return installed_sglang_version()

    def compute_identity(
        self,
        args: LaunchArgs,
        options: IdentityOptions,
        *,
        cache: DigestCache | None,
        progress: ProgressFactory | None,
        installed: Installed,
    ) -> Digested:
        return compute_identity(args, options, cache=cache, progress=progress, installed=installed)

    def server_env(
        self, command: Sequence[str], storage_dir: Path, environ: Mapping[str, str]
    ) -> dict[str, str]:
        return {STORAGE_DIR_ENV: str(storage_dir)}

    def server_launch(
        self, command: Sequence[str], storage_dir: Path, environ: Mapping[str, str]
    ) -> tuple[list[str], dict[str, str]]:
        """The command with the storage dir of its own env prefix (`env VAR=… sglang …`, which
        would win over the environment) pointed at the namespace too."""
        ours = f"{STORAGE_DIR_ENV}={storage_dir}"
        at = split_env(command)[1]
        argv = [
            ours if i < at and t.startswith(f"{STORAGE_DIR_ENV}=") else t
            for i, t in enumerate(command)
        ]
        return argv, {**environ, STORAGE_DIR_ENV: str(storage_dir)}

    def identity_warnings(self, identity: Digested) -> list[str]:
        if not isinstance(identity, Identity):
            return []
        said = unread_scales_warning(identity.kv_cache_scales)
        return [said] if said else []

    def init_warnings(
        self,
        args: LaunchArgs,
        storage_dir: Path,
        *,
        layout: Layout,
        environ: Mapping[str, str],
        hands_env: bool,
    ) -> list[str]:
        conflicts = storage_dir_conflicts(args, storage_dir, layout, environ)
        told = [w for w in (_conflict_warning(c, hands_env) for c in conflicts) if w]
        return [*_unused(args, storage_dir), *told]

    def exec_refusal(self, args: LaunchArgs, *, layout: Layout, environ: Mapping[str, str]) -> None:
        foreign = foreign_storage_env(environ, layout)
        if foreign is not None:
            raise ConfigError(
                f"environment variable {STORAGE_DIR_ENV} is set to {foreign}; exec would "
                "replace it with the namespace dir: unset it (cachemgr owns the storage dir)"
            )

    def exec_warnings(
        self, args: LaunchArgs, storage_dir: Path, *, layout: Layout, environ: Mapping[str, str]
    ) -> list[str]:
        warnings = _unused(args, storage_dir)
        for c in storage_dir_conflicts(args, storage_dir, layout, environ):
            if not c.beats_env:
                warnings.append(
                    f"{c.source} {c.path} is ignored: {STORAGE_DIR_ENV} set by cachemgr takes "
                    "precedence in SGLang"
                )
        return warnings

    def lint(
        self,
        command: Sequence[str],
        *,
        layout: Layout,
        policy: GcPolicy,
        identity: Callable[[], Digested | None],
        environ: Mapping[str, str],
    ) -> list[Finding]:
        args = resolve_launch_args(command)
        env = server_environ(command, environ)
        return lint.lint(
            args,
            layout=layout,
            env=env,
            model_config=lint.model_config(args, env),
            cap_bytes=policy.max_bytes,
            identity=identity,
            command=command,
        )

    def probe(self, settings: Settings, hooks: ProbeHooks) -> Probe | None:
        """The poll of the server's /metrics and /server_info, with `sglang_url` set."""
        if not settings.sglang_url:
            return None
        return ProbeLoop(settings.sglang_url, hooks, interval=settings.sglang_poll_interval)


def _unused(args: LaunchArgs, storage_dir: Path) -> list[str]:
    """The warning that the server will write nothing to its namespace dir, if it will not."""
    unused = lint.no_file_backend(args)
    if unused is None:
        return []
    return [f"{unused.message}; SGLang will write no page to {storage_dir} ({unused.fix})"]


def _conflict_warning(c: StorageDirConflict, hands_env: bool) -> str | None:
    """What to tell about another storage dir setting; None when ours replaces it anyway."""
    if c.beats_env:
        if c.ours and hands_env:
            return None  # our own env file from an earlier run: the new one replaces it
        return (
            f"{c.source} is set to {c.path}; SGLang reads it before anything else, so a server "
            "started with this environment bypasses cachemgr: unset it"
        )
    if hands_env:
        return (
            f"{c.source} is {c.path}; {STORAGE_DIR_ENV} from cachemgr overrides it in SGLang, "
            "remove it from the launch command"
        )
    return (
        f"{c.source} is {c.path}: SGLang uses it unless the server gets {STORAGE_DIR_ENV} "
        "(use --env-file, --print-env or `cachemgr exec`)"
    )


SGLANG = SGLangEngine()
