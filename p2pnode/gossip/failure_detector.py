"""Phi-accrual failure detection (Hayashibara et al. 2004), in chitchat's simplified form.

For each node, the detector keeps a bounded window of the intervals between the moments its heartbeat was seen to
advance (directly or relayed by anyone: gossip carries heartbeats transitively), per heartbeat step: an advance by
k steps after t seconds is one sample of t / k. A far observer sees a node's heartbeat in jumps (2 or 3 rounds at a
time, as relays happen to bring it); counting a jump as one interval made its mean ~10-20% longer than the node's
round, and every death was declared that much later there (the last observer of a death at 200 nodes: 11-12 s).
Then

    phi(now) = (now - last advance) / mean(window)

which is -log10 of the probability of waiting that long under an exponential inter-arrival model, up to the
constant factor 1/ln(10) that Cassandra keeps and chitchat drops. A node is suspect above ``suspect_phi`` and dead
above ``phi_threshold``: with the defaults (4, 8) and a mean interval of about one gossip round, a silent node is
dead ~8 rounds after its last heartbeat reached us.

Invariants: a window starts with one sample of ``initial_interval_s`` (no division by an unknown mean before the
second heartbeat), dropped once ``REAL_SAMPLES_TO_DROP_GUESS`` real intervals are in (a 2 s guess among twenty 1 s
intervals still stretched every judgement by 5%); intervals longer than ``max_interval_s`` are dropped (a
partition or a pause does not inflate the mean); the window holds at most ``window`` samples; a node declared dead
starts a fresh window when it comes back (its earlier rhythm says nothing about the new one) -- the caller does that
by ``remove`` then ``heartbeat``.

**This node's own stalls are not its peers' silence.** When this node's event loop is held up (a flood of inbound
messages to open, a long garbage collection, the process frozen), heartbeats that its peers sent on time wait
unread, and the time passes all the same: judged on the clock alone, every peer looked silent for as long as this
node was stalled. So the agent reports how late its round timer fired (``stalled``), and a silence is judged net of
the stall this node accumulated since that peer's last heartbeat was seen: ``phi = (now - last advance - local stall
since) / mean``. Measured before (an insider flood of 150 signed messages a second into 4 nodes, docs/results.md):
an honest peer turned suspect 20 s into the flood, and all three at once 35 s after it, while ``GetStatus`` took up
to 4.9 s on the same loop. What it costs: a real death is declared later by as long as this node stalled meanwhile.

**A catch-up is not a rhythm.** A node that first hears of a member through a relay rounds behind, and then from
fresher ones, sees its heartbeat advance faster than the member beats (4 steps in 1.8 s); while the window holds
only those samples (the guess is dropped after 4), its mean said 0.44-0.69 s and an ordinary 2-s silence read as
phi up to 3.3 (300 members joining in 3 digest shards; the highest live phi at 1,000 members, 7.2, came from the
join too). A member beats once a round, so a silence is judged against a mean of at least ``min_interval_s`` (the
membership passes 0.75 of its own round: a rhythm steady at 0.95-1.07 s is untouched).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable

__all__ = ["FailureDetector", "SamplingWindow"]

#: Real intervals after which the window's initial guess is dropped.
REAL_SAMPLES_TO_DROP_GUESS = 4


class SamplingWindow:
    """The last ``size`` heartbeat inter-arrival intervals of one node, with their running sum."""

    __slots__ = (
        "_guess",
        "_intervals",
        "_real",
        "_sum",
        "last_count",
        "last_heartbeat",
        "max_interval_s",
        "stall_mark",
    )

    def __init__(self, size: int, initial_interval_s: float, max_interval_s: float, now: float) -> None:
        self._intervals: deque[float] = deque(maxlen=size)
        self._sum = 0.0
        self.max_interval_s = max_interval_s
        self._append(initial_interval_s)
        self._guess = True  # the initial guess is still counted (at the window's left end, while it fits)
        self._real = 0
        self.last_heartbeat = now
        self.last_count: int | None = None  # the heartbeat counter last seen, when the caller says it
        self.stall_mark = 0.0  # the detector's local stall total when the last heartbeat was seen

    def _append(self, interval: float) -> None:
        intervals = self._intervals
        if len(intervals) == intervals.maxlen:
            self._sum -= intervals[0]
        intervals.append(interval)
        self._sum += interval

    def heartbeat(self, now: float, count: int | None = None) -> None:
        interval = now - self.last_heartbeat
        steps = 1
        if count is not None:
            if self.last_count is not None and count > self.last_count:
                steps = count - self.last_count
            self.last_count = count
        if 0.0 < interval <= self.max_interval_s:
            self._append(interval / steps)
            self._real += 1
            if self._guess and self._real >= REAL_SAMPLES_TO_DROP_GUESS:
                self._guess = False
                if 1 + self._real <= (self._intervals.maxlen or 0):  # else the deque has pushed it out already
                    self._sum -= self._intervals.popleft()
        self.last_heartbeat = max(self.last_heartbeat, now)

    @property
    def mean(self) -> float:
        return self._sum / len(self._intervals)

    def __len__(self) -> int:
        return len(self._intervals)

    def phi(self, now: float, stalled_since: float = 0.0, min_mean: float = 0.0) -> float:
        """phi at ``now``, the silence net of ``stalled_since`` seconds this node itself was stalled meanwhile, judged
        against a mean of at least ``min_mean``."""
        return max(0.0, now - self.last_heartbeat - stalled_since) / max(self.mean, min_mean)


class FailureDetector:
    """Per-node sampling windows; the membership layer turns phi into alive / suspect / dead."""

    def __init__(
        self, window: int, initial_interval_s: float, max_interval_s: float, min_interval_s: float = 0.0
    ) -> None:
        if window < 1 or initial_interval_s <= 0 or max_interval_s <= 0 or min_interval_s < 0:
            raise ValueError("window, initial_interval_s and max_interval_s must be positive, min_interval_s >= 0")
        self.window = window
        self.initial_interval_s = initial_interval_s
        self.max_interval_s = max_interval_s
        #: The least mean a silence is judged against (module docstring, "A catch-up is not a rhythm").
        self.min_interval_s = min_interval_s
        self._windows: dict[str, SamplingWindow] = {}
        #: Seconds this node itself was stalled, in all (``stalled``): discounted from every silence that spans them.
        self.stall_total = 0.0

    def stalled(self, seconds: float) -> None:
        """This node's own processing was held up ``seconds`` (its round timer fired that late): heartbeats that
        arrived meanwhile waited unread, so that time does not count as any peer's silence."""
        if seconds > 0.0:
            self.stall_total += seconds

    def heartbeat(self, node_id: str, now: float, count: int | None = None) -> None:
        """The node's heartbeat was seen to advance at ``now`` (to ``count``, when known: a jump of several steps is
        sampled per step)."""
        window = self._windows.get(node_id)
        if window is None:
            window = self._windows[node_id] = SamplingWindow(
                self.window, self.initial_interval_s, self.max_interval_s, now
            )
            window.last_count = count
        else:
            window.heartbeat(now, count)
        window.stall_mark = self.stall_total

    def phi(self, node_id: str, now: float) -> float | None:
        """The node's current phi, or None when it was never heard of (or removed)."""
        window = self._windows.get(node_id)
        return None if window is None else window.phi(now, self.stall_total - window.stall_mark, self.min_interval_s)

    def stalest(self, count: int, among: Callable[[str], bool]) -> list[str]:
        """The ``count`` nodes (of those ``among`` accepts) whose heartbeat was seen to advance longest ago."""
        windows = self._windows.items()
        oldest = heapq.nsmallest(count, ((w.last_heartbeat, node_id) for node_id, w in windows if among(node_id)))
        return [node_id for _, node_id in oldest]

    def mean_interval(self, node_id: str) -> float | None:
        window = self._windows.get(node_id)
        return None if window is None else window.mean

    def remove(self, node_id: str) -> None:
        self._windows.pop(node_id, None)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._windows
