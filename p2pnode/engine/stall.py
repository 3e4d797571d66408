"""An engine that has work and stops stepping: told apart from a busy one, and from a dead one.

vLLM notices a core that dies (``AsyncLLM.errored``), not one that hangs: a core process stopped (SIGSTOP, a
debugger), stuck in a driver call or a collective, or deadlocked keeps its sockets open and sends nothing. Its
requests then wait forever where the client set no deadline, and peers keep routing to it by its last load. A busy
engine steps: every step reports its scheduler's figures (vLLM's stat loggers, once per step while it has work,
chunked prefill included), so "work and no step for ``timeout_s``" is a hang, not a long prompt, wherever one step
is shorter than ``timeout_s`` (``DEFAULT_ENGINE_STALL_TIMEOUT_S``).

Invariants: an engine is stalled only while it has work (an idle engine does not step: its clock starts when work
arrives); once stalled it stays stalled until it steps again, even when its requests are aborted meanwhile (the node
then fails them, refuses new ones, and sends a probe so that a core that resumes has a step to take); a
``timeout_s`` of 0 watches nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["StepWatch"]


class StepWatch:
    """When an engine last showed progress, and whether it has stalled (module docstring). The engine calls
    ``stepped`` on each step report; readers call ``stalled_s`` -- an idle engine's reading starts its clock (the
    node reads it before each request enters, and every second)."""

    __slots__ = ("_clock", "_progress_at", "_stalled", "timeout_s")

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not timeout_s >= 0:
            raise ValueError(f"engine stall timeout must be >= 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self._clock = clock
        self._progress_at = clock()
        self._stalled = False

    def stepped(self) -> None:
        """The engine reported a step: it makes progress (a stalled one has resumed)."""
        self._progress_at = self._clock()
        self._stalled = False

    def stalled_s(self, unfinished: int) -> float:
        """Seconds without a step of an engine that has stalled (0.0: it has not): it held ``unfinished`` requests
        and took no step for ``timeout_s``, or did so earlier and has not stepped since."""
        if not self.timeout_s:
            return 0.0
        now = self._clock()
        if not self._stalled:
            if not unfinished:
                self._progress_at = now  # idle: nothing to step; work that comes is timed from here
                return 0.0
            if now - self._progress_at < self.timeout_s:
                return 0.0
            self._stalled = True
        return max(now - self._progress_at, 1e-9)
