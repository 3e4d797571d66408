"""Waiting in tests: poll a condition until it holds, or fail saying what never happened.

What a test waits for (a gossip round, a KV event, a counter bumped when a handler ends) happens on another task,
thread or process, at a time no test can know: so the test polls, and never sleeps a fixed time and hopes. Polls
start every few milliseconds (an in-process condition is usually met within a turn or two of the event loop) and
back off to ``MAX_EVERY_S`` (a status call to a real node costs its CPU).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

#: The first poll's wait, and the longest one: each wait doubles the one before, up to that.
FIRST_EVERY_S = 0.005
MAX_EVERY_S = 0.05
#: How long a test waits by default before it fails: far beyond what anything takes on a loaded 2-core host.
LIMIT_S = 30.0

Description = str | Callable[[], str]


def _failure(what: Description, limit_s: float, last: object) -> AssertionError:
    described = what() if callable(what) else what
    return AssertionError(f"timed out after {limit_s:g} s waiting for {described}; last seen: {last!r}")


async def until(
    check: Callable[[], T | Awaitable[T]],
    what: Description,
    limit_s: float = LIMIT_S,
    *,
    holds: Callable[[T], object] = bool,
) -> T:
    """Call ``check`` (plain or async) until its result ``holds`` (by default: is true), and return that result; fail
    after ``limit_s`` naming ``what`` (a string, or a function that describes the state then) and the last result."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    every = FIRST_EVERY_S
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if holds(result):  # type: ignore[arg-type]
            return result  # type: ignore[return-value]
        if loop.time() > deadline:
            raise _failure(what, limit_s, result)
        await asyncio.sleep(every)
        every = min(every * 2, MAX_EVERY_S)


def until_sync(
    check: Callable[[], T], what: Description, limit_s: float = LIMIT_S, *, holds: Callable[[T], object] = bool
) -> T:
    """``until`` for a test that is not a coroutine: blocks the calling thread between polls."""
    deadline = time.monotonic() + limit_s
    every = FIRST_EVERY_S
    while True:
        result = check()
        if holds(result):
            return result
        if time.monotonic() > deadline:
            raise _failure(what, limit_s, result)
        time.sleep(every)
        every = min(every * 2, MAX_EVERY_S)
