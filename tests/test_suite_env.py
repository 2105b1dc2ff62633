"""The suite's own environment: what the host's disk looks like is no test's business."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachemgr.settings import load_settings


@pytest.mark.usefixtures("no_caller_settings")
def test_a_test_that_drops_the_callers_settings_keeps_the_floors_off(tmp_path: Path) -> None:
    # A CI box with 7% free made daemons under the default 5% floor delete test pages.
    s = load_settings(root=tmp_path)
    assert (s.gc_min_free_percent, s.gc_min_free_inodes_percent) == (0, 0)
