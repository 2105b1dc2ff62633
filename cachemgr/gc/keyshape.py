"""A page key as the chain model keeps it: its 64-hex run packed to 32 bytes, and the rest of
it, its *shape*, given a number (cachemgr.gc.pagestore).

SGLang's keys are the run itself (PLAIN). A nested page's key is its path (vLLM's
`<folder>_r0/<h[:3]>/<h[3:5]>_g0/<h>.bin`): kept whole, each was a ~250-byte string, 293 bytes
a block at ten million (bench/RESULTS.md). Packed, what is left is the dirs, with the leads
that repeat the run's digits marked, and what follows the run: a handful of shapes a folder.
A shape is a function of the key alone, and hashed with its run into the key's fingerprint.
"""

from __future__ import annotations

import functools
import re
from array import array
from collections.abc import Iterator
from typing import Any

import xxhash

from cachemgr.gc.keyfile import KEY_BYTES

# What a key holds besides its 64-hex run: what comes before it, each slice of the run that a
# dir name repeats marked (_mark), and what comes after. A 64-hex key is PLAIN.
Shape = tuple[str, str]
PLAIN: Shape = ("", "")
Packed = tuple[bytes, Shape]  # a key's run as 32 bytes, and its shape
_RUN = re.compile("(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")
_RUN_AT = re.compile("[0-9a-f]{64}(?![0-9a-f])")  # matched where a path's file name starts
_LEAD = re.compile("[0-9a-f]*")  # a dir name's leading hex digits
# A marked slice of the run: MARK, then its offset and length as one character each. A key is
# a file's name or path, which never holds a NUL.
MARK = "\0"
_SLICE_MIN = 2  # a dir name that starts with fewer of the run's digits is taken as it is


def _raw(key: str) -> bytes | None:
    """The 32 bytes of a 64-digit lowercase hex key, or None for a key of another shape."""
    if len(key) != 2 * KEY_BYTES or not (key.islower() or key.isdigit()):
        return None  # (bytes.fromhex would take uppercase digits: they would not round-trip)
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        return None
    return raw if len(raw) == KEY_BYTES else None  # (it skips spaces)


def pack(key: str) -> Packed | None:
    """A key packed: a 64-digit lowercase hex key's 32 bytes (PLAIN), or those of the last
    such run in a longer key (a path) with the rest of the key as its shape; None for a key
    with no such run. `unpack` gives the key back. The shape is a function of the key alone
    (its fingerprint hashes it: a key given two shapes would be two pages)."""
    if len(key) == 2 * KEY_BYTES:
        raw = _raw(key)
        return None if raw is None else (raw, PLAIN)
    # A path's file name starts with its run (vLLM's blocks): no search of the whole key.
    run = _RUN_AT.match(key, key.rfind("/") + 1)
    if run is None:
        runs = [*_RUN.finditer(key)]
        run = runs[-1] if runs else None
    if run is None or MARK in key:
        return None
    digits = run.group()
    return bytes.fromhex(digits), (_mark(key[: run.start()], digits), key[run.end() :])


def _mark(before: str, digits: str) -> str:
    """`before` (the dirs above a key's run) with each dir name whose leading hex digits, all
    of them, are the run's next ones marked (vLLM's `<h[:3]>/<h[3:5]>_g0/`): one shape for
    all of a folder's keys. All of them: a folder named `deepseek-ai_…` is not marked for a
    run that starts `de` (its lead is `dee`), or 1 key in 256 had a shape of its own."""
    out, at = [], 0
    for part in before.split("/"):
        lead = _LEAD.match(part)
        n = lead.end() if lead else 0  # (it always matches, maybe nothing)
        if n >= _SLICE_MIN and part[:n] == digits[at : at + n]:
            out.append(f"{MARK}{chr(at)}{chr(n)}{part[n:]}")
            at += n
        else:
            out.append(part)
    return "/".join(out)


def sound(shapes: list[Shape], numbers: array[Any]) -> bool:
    """Whether a loaded store's shapes can name its keys: PLAIN first, each mark whole and
    within a run, each slot's number one of them (a snapshot that passed its CRC but not this
    would fail later, in an eviction's naming of its victims)."""
    if not shapes or shapes[0] != PLAIN or (numbers and max(numbers) >= len(shapes)):
        return False
    try:
        return all(at + n <= 2 * KEY_BYTES for b, _ in shapes for _, at, n in _marks(b))
    except IndexError:  # a mark cut short
        return False


def _marks(before: str) -> Iterator[tuple[int, int, int]]:
    """Each mark of a shape's `before`, in order: (where it starts, the run's offset, length).
    Read in order, not by looking for NULs: an offset of 0 is a NUL too."""
    i = 0
    while (j := before.find(MARK, i)) >= 0:
        yield j, ord(before[j + 1]), ord(before[j + 2])
        i = j + 3


def unpack(digits: str, shape: Shape) -> str:
    """The key of a run's `digits` and its shape (`pack`'s inverse)."""
    before, after = shape
    if MARK not in before:
        return before + digits + after
    out, i = [], 0
    for j, at, n in _marks(before):
        out += [before[i:j], digits[at : at + n]]
        i = j + 3
    return "".join(out) + before[i:] + digits + after


def key_fingerprint(packed: Packed | None, key: str) -> int:
    """A key's 64-bit fingerprint, the same in every process (Python's hash is salted per
    process): the key table is saved with the model (cachemgr.gc.modelfile) and loaded, not
    rebuilt. Hashed, not the key's first bytes: a format's keys need not be random. A shaped
    key's shape is hashed with its run: vLLM's group dirs `_g0` and `_g1` hold two pages of
    one hash."""
    if packed is None:
        return xxhash.xxh3_64_intdigest(key.encode())
    raw, shape = packed
    return xxhash.xxh3_64_intdigest(raw if shape == PLAIN else raw + _shape_bytes(shape))


@functools.lru_cache(maxsize=1 << 10)
def _shape_bytes(shape: Shape) -> bytes:
    return MARK.join(shape).encode("utf-8", "surrogatepass")


def fingerprint(key: str) -> int:
    """The fingerprint a slot of `key` has (PageStore.fps)."""
    return key_fingerprint(pack(key), key)
