# Types of the C extension built from _rank.c.
from _typeshed import ReadableBuffer as Buffer

def leaf_slots(leaf: Buffer, ns: Buffer, wanted: Buffer | None, /) -> bytes: ...
def split(
    leaves: Buffer,
    pred: Buffer,
    time: Buffer,
    before: float,
    held: Buffer,
    reads: Buffer,
    born: Buffer,
    clock: int,
    /,
) -> tuple[bytes, bytes, tuple[int, int, int, int, int]]: ...
def rank(
    one: Buffer,
    leaves: Buffer,
    reads: Buffer,
    born: Buffer,
    last: Buffer,
    time: Buffer,
    clock: int,
    trial_end: float,
    mode: int,
    shape: float,
    rate: float,
    /,
) -> tuple[bytes, bytes]: ...
