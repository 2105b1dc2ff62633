"""What the chain model remembers of evicted chain heads. A chain whose head was evicted and
that comes back (SGLang writes it again from its first missing page) is the same conversation:
its returns so far say how often it comes back. Without this memory a popular chain evicted
once restarts as unknown, and cachemgr.gc.value (which values a segment by its head's returns
and age) would rank it as any new chain.

Bounded: the oldest entries are forgotten first (~380 bytes each). In memory only: a daemon
restart forgets them (the index keeps the pages on disk, not the evicted).
"""

from __future__ import annotations

from collections import OrderedDict

from cachemgr.gc.pagestore import GHOST, NONE, PageStore

REMEMBER = 16_384  # evicted chain heads remembered at most (~6 MB: the daemon's RSS budget)


class History:
    """(namespace, key) -> (reads, born) of the chain heads evicted, oldest first."""

    def __init__(self, size: int = REMEMBER) -> None:
        self.size = size
        self._heads: OrderedDict[tuple[str, str], tuple[int, int]] = OrderedDict()

    def evicted(self, st: PageStore, s: int) -> None:
        """Page `s` leaves the disk: remember it if it heads a chain that was read."""
        if not st.reads[s] or _below_gap_or_inside(st, s):
            return
        k = (st.ns_names[st.ns[s]], st.key(s))
        self._heads[k] = (st.reads[s], st.born[s])
        self._heads.move_to_end(k)
        if len(self._heads) > self.size:
            self._heads.popitem(last=False)

    def returned(self, st: PageStore, s: int) -> None:
        """Page `s` was written again (its link set): a remembered head's chain came back. It
        keeps its returns, plus this one, and its age. Not a page behind a gap: one there
        stays unread (cachemgr.gc.value reaps such a page first)."""
        if not self._heads or _below_gap_or_inside(st, s):
            return  # (empty at every start: a load of a million pages builds no key for it)
        known = self._heads.pop((st.ns_names[st.ns[s]], st.key(s)), None)
        if known is not None:
            st.reads[s], st.born[s] = known[0] + 1, known[1]


def _below_gap_or_inside(st: PageStore, s: int) -> bool:
    """Whether `s` is no chain head: its predecessor is gone, or continues only into it."""
    up = st.pred[s]
    return up != NONE and (st.files[up] == GHOST or st.kids[up] < 2)
