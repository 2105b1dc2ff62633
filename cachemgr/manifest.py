"""A namespace's manifest, <root>/ns/<id>.json: which identity its pages belong to, and since when.

It sits next to the namespace dir, never inside it: SGLang's `clear()` deletes every file in
its storage dir. It is written atomically (temp + fsync + rename) relative to a descriptor of
<root>/ns opened without following symlinks.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

from cachemgr import __version__
from cachemgr.errors import ConfigError, StateError
from cachemgr.layout import NS_DIR, Layout, check_ns_id
from cachemgr.safefs import open_dir, write_atomic_at

MANIFEST_VERSION = 1


@dataclass(frozen=True)
class Manifest:
    """What ns/<id>.json holds; `identity` is the identity record as JSON data."""

    ns_id: str
    digest: str
    identity: dict[str, Any]
    created_at: float
    last_active_at: float
    cachemgr_version: str = __version__
    manifest_version: int = MANIFEST_VERSION

    def touched(self, now: float) -> Manifest:
        """The same manifest, last active at `now`, written by this cachemgr version."""
        return replace(self, last_active_at=now, cachemgr_version=__version__)

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), indent=2, sort_keys=True) + "\n").encode()

    @property
    def model(self) -> str | None:
        """The served model name from the identity record, if it has one."""
        source = self.identity.get("source")
        return source.get("served_model_name") if isinstance(source, dict) else None

    @property
    def kv_cache_dtype(self) -> str | None:
        return self.identity.get("kv_cache_dtype")

    @property
    def page_size(self) -> int | None:
        return self.identity.get("page_size")


def write_manifest(layout: Layout, manifest: Manifest) -> None:
    """Write ns/<id>.json atomically; a symlink anywhere on the way is refused."""
    name = f"{check_ns_id(manifest.ns_id)}.json"
    try:
        with open_dir(layout.root, NS_DIR) as fd:
            write_atomic_at(fd, name, manifest.to_bytes())
    except OSError as e:
        raise ConfigError(f"cannot write manifest {layout.manifest(manifest.ns_id)}: {e}") from e


def read_manifest(layout: Layout, ns_id: str) -> Manifest | None:
    """The manifest of `ns_id`, None if there is none; StateError if it is unreadable."""
    name = f"{check_ns_id(ns_id)}.json"
    try:
        with open_dir(layout.root, "ns") as dir_fd:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            with os.fdopen(fd, "rb") as f:
                raw = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StateError(f"cannot read manifest {layout.manifest(ns_id)}: {e.strerror}") from e
    return parse_manifest(raw, ns_id, where=str(layout.manifest(ns_id)))


def parse_manifest(raw: bytes, ns_id: str, *, where: str) -> Manifest:
    """Validate a manifest's bytes; StateError saying what is wrong with them."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StateError(f"manifest {where} is not JSON: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("identity"), dict):
        raise StateError(f"manifest {where} has no identity record")
    if data.get("manifest_version") != MANIFEST_VERSION:
        raise StateError(
            f"manifest {where} has version {data.get('manifest_version')!r}, "
            f"this cachemgr reads {MANIFEST_VERSION}"
        )
    if data.get("ns_id") != ns_id:
        raise StateError(f"manifest {where} names namespace {data.get('ns_id')!r}")
    try:
        return Manifest(
            ns_id=ns_id,
            digest=str(data["digest"]),
            identity=data["identity"],
            created_at=float(data["created_at"]),
            last_active_at=float(data["last_active_at"]),
            cachemgr_version=str(data.get("cachemgr_version", "?")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise StateError(f"manifest {where} is missing or has a bad field: {e}") from e
