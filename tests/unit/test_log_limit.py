"""The rate-limited logger (p2pnode/log_limit.py): a burst per kind per interval, the rest counted and reported; a
bounded table of kinds that frees itself as intervals end, whether or not anybody calls ``flush``."""

from __future__ import annotations

import logging

import pytest

from p2pnode.config import LOG_LIMIT_MAX_KINDS
from p2pnode.log_limit import OTHER_KIND, LogLimiter


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_kind_gets_its_burst_and_the_next_line_reports_what_was_held_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    limiter = LogLimiter(logging.getLogger("test.limit"), burst=2, interval_s=60.0, clock=clock)
    with caplog.at_level(logging.WARNING, "test.limit"):
        logged = [limiter.warning("refused:B", "refused %s", i) for i in range(5)]
        clock.now = 61.0
        limiter.warning("refused:B", "refused again")
    assert logged == [True, True, False, False, False]
    assert [r.getMessage() for r in caplog.records] == [
        "refused 0", "refused 1", "refused again (3 similar line(s) held back in the previous 60 s)",
    ]


def test_new_kinds_keep_their_own_burst_after_the_table_filled_once_without_a_flush(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A limiter nobody flushes (the ingress's failures by peer and code, say) once held ``LOG_LIMIT_MAX_KINDS``
    kinds forever: every later kind shared one burst a minute under ``(other)``, whatever time had passed."""
    clock = _Clock()
    limiter = LogLimiter(logging.getLogger("test.limit"), burst=1, interval_s=60.0, clock=clock)
    with caplog.at_level(logging.WARNING, "test.limit"):
        for i in range(LOG_LIMIT_MAX_KINDS):
            limiter.warning(f"failed:peer{i}", "peer %d failed", i)
        limiter.warning("failed:late", "late peer failed")  # table full within the interval: (other)
        assert OTHER_KIND in limiter._windows
        clock.now = 120.0  # every interval is over
        caplog.clear()
        assert limiter.warning("failed:new1", "new peer 1 failed")
        assert limiter.warning("failed:new2", "new peer 2 failed")  # its own kind, not (other)'s spent burst
    assert [r.getMessage() for r in caplog.records] == ["new peer 1 failed", "new peer 2 failed"]
    assert len(limiter._windows) <= LOG_LIMIT_MAX_KINDS
