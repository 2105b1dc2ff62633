"""The metrics refresher's failures: said, at most once a minute, a traceback only for the
unexpected (a symlinked ns/ failed every refresh with one, every second, without limit)."""

from __future__ import annotations

import logging

import pytest

from cachemgr.daemon.refresher import WARN_EVERY, Refresher
from cachemgr.errors import UnsafePathError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def failing(error: Exception) -> Refresher:
    def refresh() -> None:
        raise error

    return Refresher(refresh, clock=Clock())


def failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "cachemgr.daemon.refresher"]


@pytest.mark.parametrize(
    "error",
    [UnsafePathError("/r/ns: a symlink or non-directory on the way"), OSError(5, "I/O error")],
)
def test_a_refresh_failing_on_the_disk_is_said_once_a_minute_without_a_traceback(
    caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    r = failing(error)
    clock = r.clock
    assert isinstance(clock, Clock)
    with caplog.at_level(logging.INFO):
        for _ in range(30):  # 30 s of refreshes
            r._refresh_once()
            clock.now += 1
        said = failures(caplog)
        assert len(said) == 1, said
        assert said[0].exc_info is None and said[0].levelno == logging.ERROR
        assert str(error) in said[0].__dict__["error"]
        clock.now += WARN_EVERY
        r._refresh_once()
        assert len(failures(caplog)) == 2
        assert failures(caplog)[1].__dict__["failures"] == 31  # how many since it started


def test_a_refresh_that_works_again_is_said(caplog: pytest.LogCaptureFixture) -> None:
    broken = True

    def refresh() -> None:
        if broken:
            raise UnsafePathError("/r/ns: a symlink")

    r = Refresher(refresh, clock=Clock())
    with caplog.at_level(logging.INFO):
        r._refresh_once()
        broken = False
        r._refresh_once()
        r._refresh_once()
    said = [rec.getMessage() for rec in failures(caplog)]
    assert said == [
        "metrics refresh failed; the last snapshot stays",
        "metrics refresh works again",
    ]
