"""Phi-accrual failure detection (Hayashibara et al. 2004), in chitchat's simplified form.

For each node, the detector keeps a bounded window of the intervals between the moments its heartbeat was seen to
advance (directly or relayed by anyone: gossip carries heartbeats transitively). Then

    phi(now) = (now - last advance) / mean(window)

which is -log10 of the probability of waiting that long under an exponential inter-arrival model, up to the
constant factor 1/ln(10) that Cassandra keeps and chitchat drops. A node is suspect above ``suspect_phi`` and dead
above ``phi_threshold``: with the defaults (4, 8) and a mean interval of about one gossip round, a silent node is
dead ~8 rounds after its last heartbeat reached us.

Invariants: a window starts with one sample of ``initial_interval_s`` (no division by an unknown mean before the
second heartbeat); intervals longer than ``max_interval_s`` are dropped (a partition or a pause does not inflate the
mean); the window holds at most ``window`` samples; a node declared dead starts a fresh window when it comes back
(its earlier rhythm says nothing about the new one) -- the caller does that by ``remove`` then ``heartbeat``.
"""

from __future__ import annotations

from collections import deque

__all__ = ["FailureDetector", "SamplingWindow"]


class SamplingWindow:
    """The last ``size`` heartbeat inter-arrival intervals of one node, with their running sum."""

    __slots__ = ("_intervals", "_sum", "last_heartbeat", "max_interval_s")

    def __init__(self, size: int, initial_interval_s: float, max_interval_s: float, now: float) -> None:
        self._intervals: deque[float] = deque(maxlen=size)
        self._sum = 0.0
        self.max_interval_s = max_interval_s
        self._append(initial_interval_s)
        self.last_heartbeat = now

    def _append(self, interval: float) -> None:
        intervals = self._intervals
        if len(intervals) == intervals.maxlen:
            self._sum -= intervals[0]
        intervals.append(interval)
        self._sum += interval

    def heartbeat(self, now: float) -> None:
        interval = now - self.last_heartbeat
        if 0.0 < interval <= self.max_interval_s:
            self._append(interval)
        self.last_heartbeat = max(self.last_heartbeat, now)

    @property
    def mean(self) -> float:
        return self._sum / len(self._intervals)

    def __len__(self) -> int:
        return len(self._intervals)

    def phi(self, now: float) -> float:
        return max(0.0, now - self.last_heartbeat) / self.mean


class FailureDetector:
    """Per-node sampling windows; the membership layer turns phi into alive / suspect / dead."""

    def __init__(self, window: int, initial_interval_s: float, max_interval_s: float) -> None:
        if window < 1 or initial_interval_s <= 0 or max_interval_s <= 0:
            raise ValueError("window, initial_interval_s and max_interval_s must be positive")
        self.window = window
        self.initial_interval_s = initial_interval_s
        self.max_interval_s = max_interval_s
        self._windows: dict[str, SamplingWindow] = {}

    def heartbeat(self, node_id: str, now: float) -> None:
        """The node's heartbeat was seen to advance at ``now``."""
        window = self._windows.get(node_id)
        if window is None:
            self._windows[node_id] = SamplingWindow(self.window, self.initial_interval_s, self.max_interval_s, now)
        else:
            window.heartbeat(now)

    def phi(self, node_id: str, now: float) -> float | None:
        """The node's current phi, or None when it was never heard of (or removed)."""
        window = self._windows.get(node_id)
        return None if window is None else window.phi(now)

    def mean_interval(self, node_id: str) -> float | None:
        window = self._windows.get(node_id)
        return None if window is None else window.mean

    def remove(self, node_id: str) -> None:
        self._windows.pop(node_id, None)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._windows
