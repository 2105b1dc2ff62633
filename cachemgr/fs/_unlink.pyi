# Types of the C extension built from _unlink.c.
from collections.abc import Sequence

def unlink_batch(
    dir_fd: int,
    parent_fd: int,
    leaf: str,
    dev: int,
    ino: int,
    names: Sequence[str],
    min_age: float,
    now: float,
    threads: int,
    nice: int,
    dry_run: bool,
    /,
) -> tuple[list[tuple[int, int]], bool]: ...
def unlink_tree(
    top_fd: int,
    parent_fd: int,
    leaf: str,
    dev: int,
    ino: int,
    mnt: int,
    dirs: Sequence[str],
    names: Sequence[Sequence[str]],
    min_age: float,
    now: float,
    threads: int,
    nice: int,
    dry_run: bool,
    /,
) -> tuple[list[tuple[int, list[tuple[int, int]]]], bool]: ...
