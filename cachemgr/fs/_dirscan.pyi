# Types of the C extension built from _dirscan.c.
import sqlite3
from collections.abc import Callable, Sequence

# (shape, kind, files, bytes, digest, untracked, {size: files})
Group = tuple[str, int, int, int, int, int, dict[int, int]]
Rules = tuple[int, int, str, int]  # (key_min, key_max, temp_lead, temp_hex)
# (size, mtime, ctime, birth time (None: not kept)) of a file
FileTimes = tuple[int, float, float, float | None]

def scan(
    dir_fd: int,
    threads: int,
    rules: Rules,
    kind_of: Callable[[str], int],
    levels: int = 0,
    dir_ok: Callable[[int, bytes], bool] | None = None,
    # (conn, lib, sql, at, key_len_of): store a row per page file as well (see the C doc)
    rows: tuple[sqlite3.Connection, str, str, float, Callable[[str], int | None]] | None = None,
    nice: int = 0,  # of the stat threads it starts (the caller's stays)
    /,
) -> tuple[list[Group], int, int, int]: ...
def page_digest(name: str, size: int, /) -> int: ...
def mount_id(fd: int, /) -> int: ...
def birth_time(path: str, /) -> float | None: ...
def stat_files(root: str, files: Sequence[tuple[str, str]], /) -> list[FileTimes | None]: ...
def sql_functions(conn: object, lib: str, /) -> bool: ...
def pinned(dir_fd: int, name: str, /) -> bool: ...
