"""What a run holding a limit tells the live daemon of its deletions, chunk by chunk: the chain
model forgets the pages each chunk recorded gone (and the stores among them the index had not
applied are pending no more), and the watcher is told of the unlinks whose IN_DELETE it drops
(cachemgr.daemon.owndeletes), but of stores the index had not applied at the plan."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence

from cachemgr.backends import FileFormat
from cachemgr.gc.chains import ChainModel
from cachemgr.gc.execute import Recorded, Unlinking
from cachemgr.gc.pagestore import PageId


def forgetting(
    model: ChainModel | None,
    gone_early: Callable[[Iterable[PageId]], None],
    stored: Sequence[PageId],
) -> Recorded | None:
    """What a run does with each chunk it recorded gone: the live chain model forgets those
    pages, and of the stores the index had not applied at the plan (`stored`), those are no
    longer pending (one spared as in flight, or refused, stays on the count)."""
    unapplied = set(stored)
    if model is None and not unapplied:
        return None
    # Each namespace's format, read once a run as the run's steps read it (not once a chunk:
    # a manifest read each 256 pages was a tenth of the model's share of an eviction).
    formats: dict[str, FileFormat] = {}

    def recorded(ns: str, names: list[str]) -> None:
        if model is not None:
            fmt = formats.get(ns) or formats.setdefault(ns, model.formats(ns))
            model.forget_gone(ns, names, fmt)
        if unapplied:
            gone_early([(ns, n) for n in names if (ns, n) in unapplied])

    return recorded


class Applied:
    """Tells `unlinking` of the names a run unlinks but the stores the index had not applied
    at the plan: it may be applying one (its stat taken, its row not written yet) as GC
    deletes it, and only the IN_DELETE queued behind the store drops that row again."""

    def __init__(self, told: Unlinking, unapplied: Iterable[PageId]) -> None:
        self.told, self.unapplied = told, set(unapplied)

    @classmethod
    def of(cls, told: Unlinking | None, unapplied: Sequence[PageId]) -> Unlinking | None:
        return told if told is None or not unapplied else cls(told, unapplied)

    def expect(self, ns: str, names: Sequence[str]) -> None:
        self.told.expect(ns, self._applied(ns, names))

    def settle(self, ns: str, names: Sequence[str], deleted: Collection[str]) -> None:
        self.told.settle(ns, self._applied(ns, names), deleted)

    def again(self, ns: str, names: Sequence[str]) -> Collection[str]:
        return self.told.again(ns, self._applied(ns, names))

    def _applied(self, ns: str, names: Sequence[str]) -> list[str]:
        """Of `names`, those the watcher is told of: settled as they were expected."""
        return [n for n in names if (ns, n) not in self.unapplied]
