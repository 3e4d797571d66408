"""The tests' poll helper (tests/polling.py): the result that held, or a failure that says what never happened."""

from __future__ import annotations

import itertools

import pytest

from tests.polling import until, until_sync


async def test_until_returns_the_first_result_that_holds() -> None:
    counter = itertools.count()
    assert await until(lambda: next(counter) >= 3 and "done", "three polls") == "done"

    async def status() -> int:
        return next(counter)

    assert await until(status, "a status of 6", holds=lambda n: n >= 6) == 6


async def test_until_fails_naming_what_and_the_last_result() -> None:
    with pytest.raises(AssertionError, match=r"waiting for the answer; last seen: 41"):
        await until(lambda: 41, "the answer", limit_s=0.02, holds=lambda n: n == 42)


def test_until_sync_polls_without_an_event_loop() -> None:
    counter = itertools.count()
    assert until_sync(lambda: next(counter), "two polls", holds=lambda n: n == 2) == 2
    with pytest.raises(AssertionError, match="the state then: 7"):
        until_sync(lambda: None, lambda: "the state then: 7", limit_s=0.02)
