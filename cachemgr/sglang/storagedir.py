"""What else points SGLang's file backend at a storage dir than the namespace dir init gives.

SGLang's HiCacheFile (hicache_storage.py) takes SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR first,
then the extra-config's file_storage_path (--file-storage-path when it has none): init hands
the first, so an environment that sets it otherwise bypasses cachemgr, and a path in the
launch is overridden.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cachemgr.layout import NS_ID_RE, Layout
from cachemgr.sglang.args import LaunchArgs, parse_extra_config
from cachemgr.sglang.hicache import STORAGE_DIR_ENV


@dataclass(frozen=True)
class StorageDirConflict:
    """A setting that points SGLang's file backend somewhere other than the namespace dir."""

    source: str
    path: str
    beats_env: bool  # True: it wins even over SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR
    ours: bool  # it points at another namespace of this root (a stale env file of ours)


def storage_dir_conflicts(
    args: LaunchArgs | None, storage_dir: Path, layout: Layout, env: Mapping[str, str]
) -> list[StorageDirConflict]:
    """What else names a storage dir. SGLang's HiCacheFile (hicache_storage.py) takes
    SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR first, then extra-config file_storage_path."""
    found = []
    value = env.get(STORAGE_DIR_ENV)
    if value and not _same(value, storage_dir):
        found.append(
            StorageDirConflict(
                f"environment variable {STORAGE_DIR_ENV}", value, True, _ours(value, layout)
            )
        )
    extra = args.extra_config if args else {}
    path = extra.get("file_storage_path")
    if args is not None and isinstance(path, str) and path and not _same(path, storage_dir):
        given = parse_extra_config(args.hicache_storage_backend_extra_config)
        source = "--file-storage-path"
        if "file_storage_path" in given:
            source = "--hicache-storage-backend-extra-config file_storage_path"
        found.append(StorageDirConflict(source, path, False, _ours(path, layout)))
    return found


def foreign_storage_env(environ: Mapping[str, str], layout: Layout) -> str | None:
    """SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR when it names a dir that is no namespace of
    this root (one that is, a stale one of ours, exec points at the new namespace instead)."""
    value = environ.get(STORAGE_DIR_ENV)
    return value if value and not _ours(value, layout) else None


def _same(path: str, storage_dir: Path) -> bool:
    return os.path.abspath(path).rstrip("/") == str(storage_dir)


def _ours(path: str, layout: Layout) -> bool:
    p = Path(os.path.abspath(path))
    return p.parent == layout.ns_root and bool(NS_ID_RE.fullmatch(p.name))
