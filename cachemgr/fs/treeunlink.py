"""What a deletion checks in a nested format's dirs (vLLM's hashed dirs), for many dirs at once:
the names' shape here, then in C (_unlink.unlink_tree), without the GIL: each dir opened a
component at a time from the namespace dir (no symlink, not on another mount), and per file
the checks of deletecheck.check_and_unlink plus every component still in its parent's entry.

vLLM's layout holds a block or two per dir: a C call (and a walk from the root) per dir cost
more than the unlinks did (bench/RESULTS.md).
"""

from __future__ import annotations

import errno
import os

from cachemgr.fs._dirscan import mount_id
from cachemgr.fs._unlink import unlink_tree
from cachemgr.fs.deletecheck import (
    DENIED,
    Checked,
    RefusalReason,
    UnlinkRules,
    Where,
    shaped_as,
    tally,
)

Part = list[tuple[str, list[str]]]  # (dir below the namespace dir, file names in it)
ON_ANOTHER_MOUNT, NOT_REACHED_DIR = -1, -2  # unlink_tree's dir statuses besides errnos
# The user's own doing (a chmod, a link or a file where a dir should be): that dir stays,
# reported; any other failure ends the run, as in a flat dir.
REFUSED_DIR = {*DENIED, errno.ELOOP, errno.ENOTDIR, ON_ANOTHER_MOUNT}


def check_and_unlink_dirs(
    where: Where,
    part: Part,
    rules: UnlinkRules,
    out: Checked,
) -> tuple[list[tuple[str, int]], bool]:
    """check_and_unlink for the files of several dirs below `where` (names come back as paths
    below it): (path, bytes freed) of those deleted, and whether a dir left its parent's entry."""
    what = rules.ours[1]
    shaped: list[list[str]] = []
    for sub, names in part:
        fits = shaped_as(names, rules.ours)
        for name, fit in zip(names, fits, strict=True):
            if not fit:
                out.refuse(f"{sub}/{name}", f"not {what}", "not_ours")
        shaped.append([n for n, fit in zip(names, fits, strict=True) if fit])
    dirs = [sub for sub, _ in part]
    results, moved = unlink_tree(*where.c_args(), mount_id(where.fd), dirs, shaped, *rules.c_args())
    ok: list[tuple[str, int]] = []
    for (sub, _), names, (dir_status, verdicts) in zip(part, shaped, results, strict=True):
        if dir_status == errno.ENOENT:  # the dir went, and its files with it
            out.vanished.extend(f"{sub}/{n}" for n in names)
        elif dir_status in REFUSED_DIR:
            reason: RefusalReason = "permission" if dir_status in DENIED else "unsafe"
            out.refuse(sub, _why_not(dir_status), reason, files=len(names))
        elif dir_status not in (0, NOT_REACHED_DIR) and out.error is None:
            out.error = OSError(dir_status, os.strerror(dir_status), sub)
        for name, (status, value) in zip(names, verdicts, strict=True):
            tally(f"{sub}/{name}", status, value, ok, out)
    return ok, moved


def _why_not(dir_status: int) -> str:
    if dir_status == ON_ANOTHER_MOUNT:
        return "on another mount than its namespace dir; not entered"
    if dir_status in (errno.ELOOP, errno.ENOTDIR):
        return "not a directory (a symlink?); not entered"
    return f"not entered: {os.strerror(dir_status)}"
