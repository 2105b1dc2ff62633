"""The on-disk layout under the root: every path under it (what an engine's file names inside a
namespace dir mean is its format's business: cachemgr.backends).

<root>/CACHEDIR.TAG    tells backup tools to skip the cache
<root>/ns/<id>/        SGLang's storage dir for one identity (only SGLang writes here)
<root>/ns/<id>.json    manifest of that identity
<root>/ns/<instance>.bind  the namespace that instance is bound to (ns/bindings.py)
<root>/.trash/         namespaces renamed away by a purge, deleted in the background
<root>/.cachemgr/      state DB and locks (movable with --state-dir)

This module is the one list of the names cachemgr writes (`Layout.written`): every writer takes
its path from here, and the planted-link tests plant a symlink at each of them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from cachemgr.errors import ConfigError, UnsafePathError

NS_DIR = "ns"
TRASH_DIR = ".trash"
STATE_DIR = ".cachemgr"  # the default state dir, inside the root
TAG_FILE = "CACHEDIR.TAG"
RESERVE_FILE = "space-reserve"
DB_FILE = "state.db"
MODEL_FILE = "chain-model.snapshot"
BIND_SUFFIX = ".bind"
# SQLite's own files beside the DB (WAL mode; a rollback journal while the mode is switched)
DB_SUFFIXES = ("", "-wal", "-shm", "-journal")
NS_ID_RE = re.compile(r"[0-9a-f]{16}")
INSTANCE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
CACHEDIR_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by cachemgr.\n"
    "# For information about cache directory tags see https://bford.info/cachedir/\n"
)


@dataclass(frozen=True)
class Layout:
    """Paths of one cache root; every path it returns is inside the root."""

    root: Path
    state_dir: Path
    # This node's name when the root is shared by a fleet (docs/fleet.md): its instances'
    # names carry it (ns/bindings.py); None on a root one node has to itself.
    node: str | None = None

    @classmethod
    def at(cls, root: Path, state_dir: Path | None = None, node: str | None = None) -> Layout:
        """Lay out `root` (absolute, not a symlink); the state dir defaults to <root>/.cachemgr."""
        root = Path(os.path.abspath(root))
        if root.is_symlink():
            raise ConfigError(
                f"root {root} is a symlink (to {os.path.realpath(root)}); pass the real path"
            )
        state = Path(os.path.abspath(state_dir)) if state_dir else root / STATE_DIR
        return cls(root=root, state_dir=state, node=node)

    @property
    def ns_root(self) -> Path:
        return self.root / NS_DIR

    @property
    def trash(self) -> Path:
        return self.root / TRASH_DIR

    @property
    def tag(self) -> Path:
        return self.root / TAG_FILE

    @property
    def db_path(self) -> Path:
        return self.state_dir / DB_FILE

    @property
    def root_lock(self) -> Path:
        """flock'd by init, purge and the daemon while they change namespaces (fs/locks.py)."""
        return self.state_dir / "root.lock"

    @property
    def gc_lock(self) -> Path:
        """flock'd by the process that leads GC (fs/leadership.py)."""
        return self.state_dir / "gc.lock"

    def index_lock(self, boot_id: str) -> Path:
        """flock'd by the daemon that indexes the root on kernel `boot_id` (daemon/indexer.py)."""
        return self.state_dir / f"index-{boot_id}.lock"

    def index_ready(self, boot_id: str) -> Path:
        """Exists while that daemon's index is built and live."""
        return self.state_dir / f"index-{boot_id}.ready"

    @property
    def reserve(self) -> Path:
        """Disk space held for the state DB, released on a full filesystem (fs/reserve.py)."""
        return self.state_dir / RESERVE_FILE

    @property
    def model_snapshot(self) -> Path:
        """The daemon's chain model as of its last clean stop (cachemgr/gc/modelfile.py)."""
        return self.state_dir / MODEL_FILE

    def lock_files(self, boot_id: str) -> tuple[Path, ...]:
        """The files the daemon flocks: a link planted at one is refused at start."""
        return self.root_lock, self.gc_lock, self.index_lock(boot_id)

    def state_files(self, boot_id: str) -> tuple[Path, ...]:
        """Every file cachemgr writes in the state dir."""
        return (
            *self.lock_files(boot_id),
            self.index_ready(boot_id),
            *db_files(self.db_path),
            recover_lock(self.db_path),
            self.reserve,
            self.model_snapshot,
        )

    def written(
        self, boot_id: str, ns_ids: tuple[str, ...] = (), instances: tuple[str, ...] = ()
    ) -> tuple[Path, ...]:
        """Every path cachemgr creates or writes under the root and the state dir, for the
        given namespaces and instances: dirs first (parents before children), then files.

        Not listed, as their names are never predictable: temp files (.<name>.<hex>.tmp-cachemgr,
        O_EXCL), .trash/<id>.<unique> entries and <db>.corrupt-<time> copies (rename targets).
        """
        files = (
            self.tag,
            *self.state_files(boot_id),
            *map(self.manifest, ns_ids),
            *map(self.binding, instances),
        )
        return (*self.written_dirs(ns_ids), *files)

    def written_dirs(self, ns_ids: tuple[str, ...] = ()) -> tuple[Path, ...]:
        """The dirs among `written`: made by create_root() and init, renamed by purge."""
        return (self.ns_root, self.trash, self.state_dir, *map(self.ns_dir, ns_ids))

    def ns_dir(self, ns_id: str) -> Path:
        """The storage dir SGLang is pointed at for namespace `ns_id`."""
        return self.ns_root / check_ns_id(ns_id)

    def manifest(self, ns_id: str) -> Path:
        return self.ns_root / f"{check_ns_id(ns_id)}.json"

    def binding(self, instance: str) -> Path:
        """The durable copy of `instance`'s binding (ns/bindings.py); never a namespace's name:
        a namespace is 16 hex digits, this ends in .bind."""
        return self.ns_root / f"{check_instance(instance)}{BIND_SUFFIX}"


def db_files(db: Path) -> tuple[Path, ...]:
    """The DB and the files SQLite keeps beside it."""
    return tuple(db.with_name(db.name + suffix) for suffix in DB_SUFFIXES)


def recover_lock(db: Path) -> Path:
    """flock'd while a corrupt DB is moved aside (state/dbfile.py)."""
    return db.with_name(db.name + ".recover-lock")


def check_ns_id(ns_id: str) -> str:
    """Return `ns_id` if it is a well-formed namespace id; anything else could name a path."""
    if not NS_ID_RE.fullmatch(ns_id):
        raise UnsafePathError(f"not a namespace id: {ns_id!r} (expected 16 lowercase hex digits)")
    return ns_id


def check_instance(name: str) -> str:
    """An instance name: letters, digits and ._:@- (it shows up in tables, logs and as a file
    name under ns/); anything else is a ConfigError."""
    if not INSTANCE_RE.fullmatch(name):
        raise ConfigError(
            f"invalid instance name {name!r}: use 1-128 letters, digits or ._:@- "
            "(starting with a letter or digit)"
        )
    return name
