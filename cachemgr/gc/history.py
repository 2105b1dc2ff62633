"""What the chain model remembers of evicted pages. A chain whose pages were evicted and that
comes back (SGLang writes it again from its first missing page) is the same conversation: its
returns so far say how often it comes back. Without this memory a popular chain evicted once
restarts as unknown, and cachemgr.gc.value (which values a segment by its top page's returns
and age) would rank it as any new chain. A page evicted before anyone read it and written
again comes back with one return: it was wanted twice (ARC's and S3-FIFO's ghost hit), so it
is no longer on trial.

Pages are remembered by their key's fingerprint (cachemgr.gc.pagestore): the key itself is on
disk. Bounded: the oldest entries are forgotten first (~300 bytes each). A clean stop saves them in
the model file and the next start takes them back (cachemgr.gc.modelfile).
"""

from __future__ import annotations

from collections import OrderedDict

from cachemgr.gc.pagestore import PageStore

REMEMBER = 16_384  # evicted pages remembered at most (~6 MB: the daemon's RSS budget)


class History:
    """(namespace, key fingerprint) -> (reads, born) of the pages evicted, oldest first."""

    def __init__(self, size: int = REMEMBER) -> None:
        self.size = size
        self._heads: OrderedDict[tuple[str, int], tuple[int, int]] = OrderedDict()

    def evicted(self, st: PageStore, s: int) -> None:
        """Page `s` leaves the disk: remember it unless it is behind a gap (unusable)."""
        if st.below_gap(s):
            return
        k = (st.ns_names[st.ns[s]], st.fps[s])
        self._heads[k] = (st.reads[s], st.born[s])
        self._heads.move_to_end(k)
        if len(self._heads) > self.size:
            self._heads.popitem(last=False)

    def returned(self, st: PageStore, s: int) -> None:
        """Page `s` was written again (its link set): a remembered page's chain came back. It
        keeps its returns, plus this one, and its age. Not a page behind a gap: one there
        stays unread (cachemgr.gc.value reaps such a page first)."""
        if not self._heads or st.below_gap(s):
            return  # (empty at every start: a load of a million pages builds no key for it)
        known = self._heads.pop((st.ns_names[st.ns[s]], st.fps[s]), None)
        if known is not None:
            st.put("reads", s, known[0] + 1)
            st.put("born", s, known[1])

    def entries(self) -> list[tuple[str, int, int, int]]:
        """(namespace, key fingerprint, reads, born), oldest first: what the model file keeps."""
        return [(ns, fp, r, b) for (ns, fp), (r, b) in self._heads.items()]

    def restore(self, entries: list[tuple[str, int, int, int]]) -> None:
        """Take saved entries back (oldest first), as many as fit."""
        for ns, fp, reads, born in entries[-self.size :]:
            self._heads[str(ns), int(fp)] = (int(reads), int(born))
