"""What the storage dir a launch would use holds: pages of this identity, of another, or of
one nobody recorded. The failure cachemgr exists for is a server hitting the last two."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cachemgr.doctor.finding import Finding, command_line
from cachemgr.errors import CachemgrError
from cachemgr.fs.dirscan import scan_usage
from cachemgr.identity.engines import parse_identity
from cachemgr.identity.record import Digested, diff_identities
from cachemgr.launchenv import split_env
from cachemgr.layout import NS_ID_RE, Layout
from cachemgr.ns.manifest import Manifest, read_manifest
from cachemgr.ns.prelaunch import with_version_of


def managed_ns(path: Path, layout: Layout) -> str | None:
    """The namespace id if `path` is <root>/ns/<id>, else None."""
    if path.parent == layout.ns_root and NS_ID_RE.fullmatch(path.name):
        return path.name
    return None


def exec_namespace(layout: Layout, identity: Callable[[], Digested | None]) -> str | None:
    """The namespace `cachemgr exec` gives a launch: its identity's, once init or exec made it
    under this root; None before that, or when the identity cannot be computed here."""
    if not layout.ns_root.is_dir():
        return None
    mine = identity()
    if mine is None or not layout.manifest(mine.ns_id).is_file():
        return None
    return mine.ns_id if layout.ns_dir(mine.ns_id).is_dir() else None


def exec_line(
    layout: Layout, command: Sequence[str], point_env: str | None, env: Mapping[str, str]
) -> str:
    """`cachemgr exec` of `command`, to paste: `point_env` (what points the server at a
    storage dir before anything exec hands it) taken out of the command's assignments, and
    unset first where the environment `env` sets it: exec refuses a launch that sets it."""
    line = command_line(layout, "exec", "--", *launched(command, point_env))
    # (`env` is the server's: the shell's with the command's over it. Set by the command
    # alone, the unset is a no-op; by the shell too, it is what exec needs)
    return f"env -u {point_env} {line}" if point_env and env.get(point_env) else line


def launched(command: Sequence[str], point_env: str | None) -> list[str]:
    """`command` without `point_env` in its assignments (`env VAR=/x sglang serve …`)."""
    at = split_env(command)[1]
    head = [t for t in command[:at] if not (point_env and t.startswith(f"{point_env}="))]
    if all(t == "env" for t in head):  # nothing left for `env` to set
        head = []
    return [*head, *command[at:]]


@dataclass(frozen=True)
class Launch:
    """A launch as doctor's fixes repeat it."""

    command: tuple[str, ...]  # without `point_env` in its assignments (launched)
    exec_line: str  # its `cachemgr exec` (exec_line)
    point_env: str  # what would point its server at a storage dir instead
    pages_ere: str  # the whole path of its page files, for find -regex (posix-extended)


def under_exec(layout: Layout, ns_id: str, given: Path, exec_cmd: str) -> Finding:
    """`cachemgr exec` points the launch's storage at its namespace, so the dir the command
    names by itself is not the one its server uses under exec."""
    return Finding(
        "info",
        "exec-namespace",
        f"under `cachemgr exec` this launch gets its namespace {ns_id} "
        f"({layout.ns_dir(ns_id)}); started without it, it would use {given}, which cachemgr "
        "does not manage",
        f"start it with `{exec_cmd}`",
    )


def lint_storage_identity(
    path: Path,
    layout: Layout,
    identity: Callable[[], Digested | None],
    launch: Launch,
) -> list[Finding]:
    """A manifest of another identity, or pages with no manifest, in the launch's storage dir.
    `identity` is called only when there is something to compare with (it may hash weights)."""
    ns_id = managed_ns(path, layout)
    try:
        manifest = read_manifest(layout, ns_id) if ns_id else None
    except CachemgrError:
        return []  # a damaged manifest: lint_root reports it with the namespace
    if manifest is None:
        pages = _pages(path)
        if not pages:
            return []
        return [
            Finding(
                "error",
                "storage-unknown-identity",
                f"storage dir {path} has {pages:,} pages and no manifest: unknown identity, "
                "pages written under another model, KV dtype or page size would be served as hits",
                _unknown_fix(path, layout, identity, launch),
            )
        ]
    mine = identity()
    if mine is None:
        return []  # the model is not here to hash: model-not-local says so
    changes = changes_since(manifest, mine)
    if not changes:
        return []
    return [
        identity_mismatch(
            f"storage dir {path}",
            changes,
            # counted only now: a namespace of millions of pages takes seconds to list
            f" and holds {_pages(path):,} pages: the server would serve them as hits and mix "
            "its own in",
            f"start the server with `{launch.exec_line}` (its own namespace), or point "
            f"{launch.point_env} at this identity's namespace",
        )
    ]


def _unknown_fix(
    path: Path,
    layout: Layout,
    identity: Callable[[], Digested | None],
    launch: Launch,
) -> str:
    """How to be rid of pages nobody vouches for. Init adopts nothing: under the root it
    writes a namespace's manifest back only where the dir's id is the launch identity's (the id
    says whose pages they are); elsewhere its pages stay unknown."""
    ns_id, mine = managed_ns(path, layout), identity()
    init, exec_cmd = command_line(layout, "init", "--", *launch.command), launch.exec_line
    if ns_id is not None:
        purge = f"purge it: `{command_line(layout, 'purge', '--namespace', ns_id, '--yes')}`"
        if mine is not None and mine.ns_id == ns_id:
            return f"its id is this launch's identity's: `{init}` writes its manifest back; {purge}"
        return f"{purge} (nobody vouches for its pages); `{exec_cmd}` gives the server its own"
    # the engine's page names only: not its temps, nor a LoRA's adapter_model.bin
    find = f"find {shlex.quote(str(path))} -maxdepth 1 -type f -regextype posix-extended"
    find += f" -regex {shlex.quote(launch.pages_ere)}"
    fix = (
        f"start the server with `{exec_cmd}` (a namespace of its own), and delete these pages: "
        f"`{find} -delete`"
    )
    if mine is not None:
        into = shlex.quote(str(layout.ns_dir(mine.ns_id)))
        fix += (
            "; if you know this very launch wrote them (the same weights, KV dtype, page size "
            f"and TP), move them into its namespace instead, before the server starts (a move "
            f"across filesystems is a copy, a page half there under its name): `{init}`, then "
            f"`{find} -exec mv -t {into} {{}} +`"
        )
    return fix


def identity_mismatch(where: str, changes: Sequence[str], effect: str, fix: str) -> Finding:
    """The finding for a dir that holds another identity's cache: `where` names the dir,
    `changes` say how the identities differ, `effect` what the server would do with it."""
    return Finding(
        "error",
        "storage-identity-mismatch",
        f"{where} belongs to another identity ({'; '.join(changes)}){effect}",
        fix,
    )


def changes_since(manifest: Manifest, mine: Digested) -> list[str]:
    """How `mine` differs from the identity `manifest` records, [] when it is the same (its
    engine version adopted as init would adopt it)."""
    theirs = parse_identity(manifest.identity)  # None: another schema, compare digests only
    if theirs is not None:
        mine = with_version_of(mine, theirs)
    if mine.digest == manifest.digest:
        return []
    return diff_identities(theirs, mine) if theirs else [f"identity: {manifest.digest}"]


def _pages(path: Path) -> int:
    """Page files in `path` (0 if it is absent or cannot be read)."""
    try:
        usage = scan_usage(Layout.at(path.parent), path.name)
    except (OSError, CachemgrError):
        return 0
    return usage.pages if usage else 0
