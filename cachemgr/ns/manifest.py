"""A namespace's manifest, <root>/ns/<id>.json: which identity its pages belong to, and since when.

It sits next to the namespace dir, never inside it: SGLang's `clear()` deletes every file in
its storage dir. It is written atomically (temp + fsync + rename) relative to a descriptor of
<root>/ns opened without following symlinks.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from cachemgr import __version__
from cachemgr.backends import FileFormat
from cachemgr.errors import ConfigError, StateError, UnsafePathError
from cachemgr.formats import format_for
from cachemgr.fs.safe import open_dir, read_regular, write_atomic_at
from cachemgr.layout import NS_DIR, Layout, check_ns_id

MANIFEST_VERSION = 1
MANIFEST_MAX_BYTES = 1 << 20  # a real one is a few KiB; a bigger file is not read at all
MAX_IDENTITY_DEPTH = 16  # the identity record nests 3 deep; json.dumps must never recurse far
MAX_TIMESTAMP = 253_402_300_799.0  # 9999-12-31T23:59:59Z: any later "time" is damage
_DIGEST_RE = re.compile(r"[0-9a-f]{16,128}")


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
        return identity_model(self.identity)

    @property
    def kv_cache_dtype(self) -> str | None:
        return identity_kv_cache_dtype(self.identity)

    @property
    def page_size(self) -> int | None:
        return identity_page_size(self.identity)


# The Manifest properties, for an identity record read from elsewhere (the DB's copy of it).


def identity_record(identity_json: str | None) -> dict[str, Any]:
    """The identity record in a namespace row's JSON; {} for a missing or damaged one."""
    try:
        record = json.loads(identity_json) if identity_json else {}
    except (ValueError, RecursionError):
        return {}
    return record if isinstance(record, dict) else {}


def identity_model(identity: dict[str, Any]) -> str | None:
    """The served model name from an identity record, if it has one."""
    source = identity.get("source")
    name = source.get("served_model_name") if isinstance(source, dict) else None
    return name if isinstance(name, str) else None


def identity_kv_cache_dtype(identity: dict[str, Any]) -> str | None:
    dtype = identity.get("kv_cache_dtype")
    return dtype if isinstance(dtype, str) else None


def identity_page_size(identity: dict[str, Any]) -> int | None:
    page = identity.get("page_size")
    return page if type(page) is int else None


def write_manifest(layout: Layout, manifest: Manifest) -> None:
    """Write ns/<id>.json atomically; a symlink anywhere on the way is refused."""
    name = f"{check_ns_id(manifest.ns_id)}.json"
    try:
        with open_dir(layout.root, NS_DIR) as fd:
            write_atomic_at(fd, name, manifest.to_bytes())
    except OSError as e:
        raise ConfigError(f"cannot write manifest {layout.manifest(manifest.ns_id)}: {e}") from e


def read_manifest(layout: Layout, ns_id: str) -> Manifest | None:
    """The manifest of `ns_id`, None if there is none; StateError if it is not a valid one
    (not a regular file, larger than MANIFEST_MAX_BYTES, or bad content)."""
    name = f"{check_ns_id(ns_id)}.json"
    where = layout.manifest(ns_id)
    try:
        with open_dir(layout.root, NS_DIR) as dir_fd:
            raw = read_regular(dir_fd, name, MANIFEST_MAX_BYTES)
    except FileNotFoundError:
        return None
    except UnsafePathError as e:  # a FIFO, a symlink, a directory, a 2 GB file: never read
        raise StateError(f"manifest {where}: {e}") from e
    except OSError as e:
        raise StateError(f"cannot read manifest {where}: {e.strerror}") from e
    return parse_manifest(raw, ns_id, where=str(where))


# The format each manifest gave when last read, for the time it cannot be read (damaged):
# a namespace id names one engine, and a vLLM dir read as SGLang's would lose its index.
_LAST_READ: dict[str, FileFormat] = {}


def format_of(layout: Layout, ns_id: str) -> FileFormat:
    """The file format of namespace `ns_id`'s dir, from its manifest's engine; SGLang's if the
    manifest is absent, or unreadable and not read before in this process. A wrong guess
    misreads nothing as a page: a flat scan never enters a subdir, and a nested one lists no
    file of the namespace dir itself (but it finds none of its pages either)."""
    where = str(layout.manifest(ns_id))
    try:
        m = read_manifest(layout, ns_id)
    except StateError:
        return _LAST_READ.get(where) or format_for(None)
    if m is None:
        _LAST_READ.pop(where, None)  # (purged: a namespace of that id may come back anew)
        return format_for(None)
    fmt = _LAST_READ[where] = format_for(m.identity)
    return fmt


def parse_manifest(raw: bytes, ns_id: str, *, where: str) -> Manifest:
    """Validate a manifest's bytes, strictly; StateError saying what is wrong with them."""
    try:
        data = json.loads(raw)
    except ValueError as e:  # not UTF-8, not JSON, an integer of 5,000 digits
        raise StateError(f"manifest {where} is not JSON: {e}") from e
    except RecursionError as e:
        raise StateError(f"manifest {where} is nested too deeply to read") from e
    if not isinstance(data, dict) or not isinstance(data.get("identity"), dict):
        raise StateError(f"manifest {where} has no identity record")
    version = data.get("manifest_version")
    if type(version) is not int or version != MANIFEST_VERSION:
        raise StateError(
            f"manifest {where} has version {version!r:.40}, this cachemgr reads {MANIFEST_VERSION}"
        )
    if data.get("ns_id") != ns_id:
        raise StateError(f"manifest {where} names namespace {data.get('ns_id')!r:.40}")
    digest, identity = data.get("digest"), data["identity"]
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest) or digest[:16] != ns_id:
        raise StateError(f"manifest {where} has no digest starting with {ns_id}")
    if _depth(identity) > MAX_IDENTITY_DEPTH:
        raise StateError(f"manifest {where} has an identity record nested too deeply")
    version_str = data.get("cachemgr_version", "?")
    if not isinstance(version_str, str):
        raise StateError(f"manifest {where} has a cachemgr_version that is not a string")
    return Manifest(
        ns_id=ns_id,
        digest=digest,
        identity=identity,
        created_at=timestamp(data, "created_at", f"manifest {where}"),
        last_active_at=timestamp(data, "last_active_at", f"manifest {where}"),
        cachemgr_version=version_str,
    )


def timestamp(data: dict[str, Any], key: str, where: str) -> float:
    """A Unix time between 1970 and 9999: NaN, 1e308, a string or a bool is refused (they
    would reach the DB as NULL, or overflow when shown as a date)."""
    value = data.get(key)
    if isinstance(value, (int, float)) and type(value) is not bool and 0 <= value <= MAX_TIMESTAMP:
        return float(value)
    raise StateError(f"{where}: {key} is {value!r:.40}, not a time since 1970")


def _depth(value: object) -> int:
    """How deeply lists and dicts nest in `value` (iterative: no recursion to run out of)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if not isinstance(item, (dict, list)):
            continue
        deepest = max(deepest, level)
        if level <= MAX_IDENTITY_DEPTH:  # one level past the limit is enough to refuse
            children = item.values() if isinstance(item, dict) else item
            stack.extend((c, level + 1) for c in children)
    return deepest
