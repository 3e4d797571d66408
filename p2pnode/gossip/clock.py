"""Time for the gossip agent: a real clock on the asyncio loop, or a simulated one that tests drive by hand.

The agent never sleeps: it asks its clock to call it back (``call_later``), reads ``now()`` (monotonic seconds,
for rounds, the failure detector and ages) and ``wall_ms()`` (Unix milliseconds, for generations and the replay
window). ``SimClock`` is a discrete-event scheduler: ``advance(30.0)`` runs every callback due in the next 30
simulated seconds, in time order, in well under a second of real time.

Invariants (SimClock): callbacks run in (due time, scheduling order) order; ``now()`` never decreases and, inside
a callback, equals that callback's due time; a callback scheduled for the past runs at the current time.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol

__all__ = ["AsyncioClock", "Clock", "SimClock", "TimerHandle"]

#: Wall-clock time (Unix ms) a SimClock reads at simulated time 0 (2024-01-01T00:00:00Z).
SIM_EPOCH_MS = 1_704_067_200_000


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """What the agent needs from time."""

    def now(self) -> float:
        """Monotonic seconds."""
        ...

    def wall_ms(self) -> int:
        """Wall-clock Unix time in milliseconds."""
        ...

    def call_later(self, delay: float, callback: Callable[[], None]) -> TimerHandle:
        """Run ``callback()`` after ``delay`` seconds (on the clock's own loop)."""
        ...


class AsyncioClock:
    """The running asyncio loop's clock; ``call_later`` must be called from inside that loop."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def wall_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def call_later(self, delay: float, callback: Callable[[], None]) -> TimerHandle:
        return asyncio.get_running_loop().call_later(max(0.0, delay), callback)


class _SimTimer:
    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class SimClock:
    """A simulated clock and event queue (see the module docstring)."""

    def __init__(self, start: float = 0.0, epoch_ms: int = SIM_EPOCH_MS) -> None:
        self._now = start
        self._epoch_ms = epoch_ms
        self._queue: list[tuple[float, int, _SimTimer]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def wall_ms(self) -> int:
        return self._epoch_ms + int(self._now * 1000)

    def call_later(self, delay: float, callback: Callable[[], None]) -> _SimTimer:
        timer = _SimTimer(self._now + max(0.0, delay), callback)
        heapq.heappush(self._queue, (timer.when, next(self._seq), timer))
        return timer

    def pending(self) -> int:
        """Callbacks scheduled and not yet run (cancelled ones included until their time comes)."""
        return len(self._queue)

    def run_until(self, t: float) -> None:
        """Run every callback due at or before ``t``, then set the time to ``t``."""
        queue = self._queue
        while queue and queue[0][0] <= t:
            when, _, timer = heapq.heappop(queue)
            if timer.cancelled:
                continue
            self._now = max(self._now, when)
            timer.callback()
        self._now = max(self._now, t)

    def advance(self, seconds: float) -> None:
        """Run the next ``seconds`` of simulated time."""
        self.run_until(self._now + seconds)

    def stall(self, seconds: float) -> None:
        """Let ``seconds`` pass with nothing run (a process frozen, or its event loop held up): every callback due
        meanwhile runs late, at the next ``run_until``."""
        self._now += seconds
