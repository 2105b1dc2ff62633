"""A read-only view of the chain model's pages (cachemgr.gc.pagestore), for tests and reports."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

from cachemgr.gc.pagestore import Page, PageId, PageStore


class PagesView(Mapping[PageId, Page]):
    """A read-only view of a store's pages on disk by (namespace, key): copies of each."""

    def __init__(self, store: PageStore, lock: threading.RLock) -> None:
        self._store, self._lock = store, lock

    def __getitem__(self, pid: PageId) -> Page:
        with self._lock:
            s = self._store.find(*pid)
            if not self._store.present(s):
                raise KeyError(pid)
            return self._store.page(s)

    def __iter__(self) -> Iterator[PageId]:
        st = self._store
        with self._lock:
            ids = [(ns, st.key(s)) for ns in st.ns_names for s in st.slots(ns)]
        return iter(ids)

    def __len__(self) -> int:
        return self._store.count
