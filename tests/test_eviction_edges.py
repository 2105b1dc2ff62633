"""Eviction on an operator's bad day: clocks that disagree, an index rebuilt under a writer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gc_helpers import NS, T0, Tree, evicted, page, policy


@pytest.fixture
def tree(root: Path) -> Iterator[Tree]:
    t = Tree.at(root)
    yield t
    t.store.close()


def test_min_age_zero_evicts_pages_last_used_in_the_future(tree: Tree) -> None:
    # The previous leader's clock ran 10 minutes ahead (or this host's clock stepped back):
    # its access times lie in the future. With no age rule they must still go, or the cap
    # cannot be held until the clock catches up.
    tree.write(NS, [page(i) for i in range(10)], at=T0 + 600)
    plan = tree.plan(policy(max_bytes=5000, high_watermark=1.0, low_watermark=0.5), now=T0)
    assert len(evicted(plan, "cap")) == 8  # down to the low watermark
    # An age rule keeps them: a future time is young (cachemgr.fs.deletecheck.too_young).
    aged = tree.plan(policy(max_bytes=5000, min_age=60.0), now=T0)
    assert evicted(aged, "cap") == []
