"""The identity record: everything that decides the byte meaning of a stored KV page.

Its digest is xxh3-128 over a canonical JSON encoding of every field except `source` (which
says where the values came from, e.g. the model's path, and must not change the digest: two
copies of a model at different paths are the same identity). The namespace id is the first
16 hex digits of the digest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

import xxhash
from pydantic import BaseModel, ConfigDict, ValidationError, computed_field

from cachemgr.canonical import canonical_json
from cachemgr.errors import ConfigError, NotFoundError, UnsafePathError
from cachemgr.fs.safe import read_regular

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class FileDigest(BaseModel):
    """One file of a model: its name inside the model dir, size and content digest."""

    model_config = _FROZEN
    name: str
    size: int
    digest: str


class Weights(BaseModel):
    """The content of a model's weight and config files."""

    model_config = _FROZEN
    mode: Literal["full", "fast"]  # fast: headers + sizes only, never equal to a full digest
    algo: str
    files: tuple[FileDigest, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


class Digested(BaseModel):
    """What every engine's identity record shares: the digest over all but `source`, and a
    version of the engine (`VERSION_FIELD`, also in `source` with its `…_from`)."""

    ENGINE: ClassVar[str]
    VERSION_FIELD: ClassVar[str]
    # Fields added within a schema version: left out of the digest while None, so every
    # launch that does not set them keeps the namespace id it had before they existed.
    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset()
    if TYPE_CHECKING:  # every engine's record has them; declared by each, in its own order
        schema_version: int
        weights: Weights
        source: Any

    def canonical(self) -> bytes:
        """The bytes the digest is taken over: sorted keys, no whitespace, `source` (and an
        unset OMIT_WHEN_NONE field) left out."""
        unset = {k for k in self.OMIT_WHEN_NONE if getattr(self, k) is None}
        data = self.model_dump(mode="json", exclude={"source", "digest", "ns_id", *unset})
        return canonical_json(data, ensure_ascii=False).encode()

    @computed_field  # type: ignore[prop-decorator]
    @property
    def digest(self) -> str:
        """xxh3-128 of the canonical encoding, 32 hex digits."""
        return xxhash.xxh3_128_hexdigest(self.canonical())

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ns_id(self) -> str:
        """The namespace id: the digest's first 16 hex digits (layout.NS_ID_RE)."""
        return self.digest[:16]

    @property
    def engine_version(self) -> str:
        return str(getattr(self, self.VERSION_FIELD))

    @property
    def engine_version_full(self) -> str | None:
        """The full version string in `source`, when known."""
        full = getattr(self.__dict__["source"], self.VERSION_FIELD)
        return None if full is None else str(full)

    @property
    def engine_version_from(self) -> str:
        return str(getattr(self.__dict__["source"], f"{self.VERSION_FIELD}_from"))

    def with_engine_version(self, version: str, full: str | None) -> Digested:
        """This record with another engine version, taken from a namespace (prelaunch.py)."""
        source = self.__dict__["source"].model_copy(
            update={self.VERSION_FIELD: full, f"{self.VERSION_FIELD}_from": "namespace"}
        )
        return self.model_copy(update={self.VERSION_FIELD: version, "source": source})


RECORD_MAX_BYTES = 1 << 20  # a record is a few KiB; a manifest holding one, not much more


RecordT = TypeVar("RecordT", bound="Digested")


def read_record_data(path: Path) -> Any:
    """The identity data in a manifest (`{"identity": {...}, ...}`) or a bare record file;
    `parse_record` makes it a record, of the class its `engine` key names."""
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:  # a FIFO is refused, not waited on; a huge file is not read past the limit
            raw = read_regular(dir_fd, path.name, RECORD_MAX_BYTES)
        finally:
            os.close(dir_fd)
    except OSError as e:
        cls = NotFoundError if isinstance(e, FileNotFoundError) else ConfigError
        raise cls(f"cannot read {path}: {e.strerror or e}") from e
    except UnsafePathError as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not JSON: {e}") from e
    except RecursionError:
        raise ConfigError(f"{path} is not an identity record: nested too deeply") from None
    if isinstance(data, dict) and isinstance(data.get("identity"), dict):
        data = data["identity"]
    return data


def parse_record(path: Path, data: Any, record: type[RecordT]) -> RecordT:
    """A `record` from the data `read_record_data` read from `path` (named in the errors)."""
    schema = record.model_fields["schema_version"].default
    if isinstance(data, dict) and data.get("schema_version", schema) != schema:
        raise ConfigError(
            f"{path}: identity schema version {data['schema_version']} is not one this "
            f"cachemgr reads ({schema})"
        )
    try:
        return record.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "record"
        raise ConfigError(f"{path} is not an identity record: {where}: {first['msg']}") from None


def diff_identities(a: Digested, b: Digested) -> list[str]:
    """Human lines saying how `b` differs from `a`; empty when the digests are equal."""
    if a.digest == b.digest:
        return []
    lines: list[str] = []
    for key in ("weights", "draft_weights"):
        lines += _diff_weights(key, getattr(a, key, None), getattr(b, key, None))
    flat_a, flat_b = _flatten(a), _flatten(b)
    for key in sorted(flat_a.keys() | flat_b.keys()):
        va, vb = flat_a.get(key), flat_b.get(key)
        if va != vb:
            lines.append(f"{key}: {_show(va)} → {_show(vb)}")
    return lines or [f"identity: {a.digest} → {b.digest}"]


def _flatten(ident: Digested) -> dict[str, Any]:
    """Scalar components as dotted keys; weights are compared per file instead."""
    data = ident.model_dump(
        mode="json", exclude={"source", "digest", "ns_id", "weights", "draft_weights"}
    )
    out: dict[str, Any] = {"engine": ident.ENGINE}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def _diff_weights(key: str, a: Weights | None, b: Weights | None) -> list[str]:
    if a is None or b is None:
        return [] if a is b else [f"{key}: {_count(a)} → {_count(b)}"]
    lines = [f"{key}.mode: {a.mode} → {b.mode}"] if a.mode != b.mode else []
    fa = {f.name: f for f in a.files}
    fb = {f.name: f for f in b.files}
    gone, new = sorted(fa.keys() - fb.keys()), sorted(fb.keys() - fa.keys())
    unmatched = list(new)
    for name in gone:
        twin = next((n for n in unmatched if fb[n].digest == fa[name].digest), None)
        if twin is not None:
            unmatched.remove(twin)
            lines.append(f"{key}: {name} renamed to {twin}")
        else:
            lines.append(f"{key}: {name} removed")
    lines += [f"{key}: {n} added" for n in unmatched]
    for name in sorted(fa.keys() & fb.keys()):
        if fa[name] != fb[name] and a.mode == b.mode:
            lines.append(f"{key}: {name} changed")
    return lines


def _count(w: Weights | None) -> str:
    return "none" if w is None else f"{len(w.files)} files"


def _show(value: Any) -> str:
    return "none" if value is None else str(value)
