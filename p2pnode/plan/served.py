"""What each destination served, and a plan's expected loads scored against it.

Why: a plan's ``expected_imbalance`` used to be its own figure -- max/mean of the loads it placed -- and read 1.06
while the nodes served 1.27 x the mean. Here the prediction meets the outcome: every node gossips the work its engine
has served with its load (``load.py``: cumulative requests, uncached prompt tokens and completion tokens, as of
``served_at``, its wall clock); every node keeps a short history of each member's figures (``ServedHistory``) and
reads off what each served over any window, interpolating linearly between reports. A plan is scored against what the
destinations served *while it was in force* -- from its creation to the next plan's, on the planner's clock -- in
the plan's own work unit (``PlanScore``), never against itself.

A window is read once every destination has reported past its end, or once ``DEFAULT_SERVED_SETTLE_S`` has passed
since its end with no newer report: a node samples its counts every ``HEALTH_CHECK_INTERVAL_S`` and publishes them
when they change, so a node that served nothing more sends nothing more.

Bounds: at most ``DEFAULT_SERVED_SAMPLES`` reports per member, spaced so that they span a few plan periods (older
ones dropped), members as gossip knows them (``retain``). A member whose counts go backwards restarted: its history
starts again.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from p2pnode.config import DEFAULT_SERVED_SAMPLES, DEFAULT_SERVED_SETTLE_S
from p2pnode.load import NodeLoad
from p2pnode.plan.plan import Plan

__all__ = ["PlanScore", "ServedHistory", "ServedTotals", "max_over_mean", "score"]


@dataclass(frozen=True, slots=True)
class ServedTotals:
    """A destination's cumulative served work as of ``at`` (its wall clock)."""

    at: float
    requests: float
    uncached_tokens: float
    completion_tokens: float

    @classmethod
    def of(cls, load: NodeLoad) -> ServedTotals:
        return cls(load.served_at, load.served_requests, load.served_uncached_tokens, load.served_completion_tokens)

    def work(self, prefill_token_cost: float, decode_token_cost: float) -> float:
        return self.uncached_tokens * prefill_token_cost + self.completion_tokens * decode_token_cost

    def counts(self) -> tuple[float, float, float]:
        return self.requests, self.uncached_tokens, self.completion_tokens


def _between(a: ServedTotals, b: ServedTotals, t: float) -> ServedTotals:
    f = (t - a.at) / (b.at - a.at)
    return ServedTotals(t, *(x + f * (y - x) for x, y in zip(a.counts(), b.counts(), strict=True)))


class ServedHistory:
    """Every member's recent served totals, from their gossiped loads; what any of them served over a window."""

    def __init__(self, max_samples: int = DEFAULT_SERVED_SAMPLES, settle_s: float = DEFAULT_SERVED_SETTLE_S) -> None:
        if max_samples < 2:
            raise ValueError(f"max_samples must be >= 2 (a window needs two reports), got {max_samples}")
        self.max_samples = max_samples
        self.settle_s = settle_s
        self._samples: dict[str, deque[ServedTotals]] = {}

    def __len__(self) -> int:
        return len(self._samples)

    def record(self, node_id: str, load: NodeLoad, min_spacing_s: float = 0.0) -> None:
        """Take a member's load as gossip delivered it (a repeat, or a load without served figures, changes
        nothing; counts or a clock that went backwards start the member's history again: it restarted).

        The newest report is always kept; older ones at least ``min_spacing_s`` apart (a new report replaces the
        newest when that one is closer than this to the one before it), so ``max_samples`` reports span at least
        ``(max_samples - 2) * min_spacing_s`` seconds whatever the reporting rate.
        """
        if not load.served_at > 0:
            return
        totals = ServedTotals.of(load)
        samples = self._samples.get(node_id)
        if samples is None:
            samples = self._samples[node_id] = deque(maxlen=self.max_samples)
        elif samples:
            last = samples[-1]
            if totals == last:
                return
            if totals.at <= last.at or any(x < y for x, y in zip(totals.counts(), last.counts(), strict=True)):
                samples.clear()
            elif len(samples) >= 2 and last.at - samples[-2].at < min_spacing_s:
                samples.pop()  # the newest was kept only as the newest: too close to the one before it
        samples.append(totals)

    def retain(self, node_ids: Iterable[str]) -> None:
        """Forget every member not in ``node_ids`` (bounds the history by the membership)."""
        keep = set(node_ids)
        for node_id in [n for n in self._samples if n not in keep]:
            del self._samples[node_id]

    def latest(self, node_id: str) -> ServedTotals | None:
        samples = self._samples.get(node_id)
        return samples[-1] if samples else None

    def at(self, node_id: str, t: float, now: float) -> ServedTotals | None:
        """The member's totals at time ``t``, or None when its reports do not tell yet (or no longer)."""
        samples = self._samples.get(node_id)
        if not samples or t < samples[0].at:
            return None
        last = samples[-1]
        if t >= last.at:  # unchanged since its last report, once any change would have been reported
            return ServedTotals(t, *last.counts()) if now - t >= self.settle_s or t == last.at else None
        lo, hi = 0, len(samples) - 1  # samples[lo].at <= t < samples[hi].at
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if samples[mid].at <= t:
                lo = mid
            else:
                hi = mid
        return _between(samples[lo], samples[hi], t)

    def served(
        self, node_id: str, start: float, end: float, now: float, prefill_token_cost: float, decode_token_cost: float
    ) -> float | None:
        """Work per second the member served in ``[start, end]`` (None when not known)."""
        if not end > start:
            return None
        a, b = self.at(node_id, start, now), self.at(node_id, end, now)
        if a is None or b is None:
            return None
        work = b.work(prefill_token_cost, decode_token_cost) - a.work(prefill_token_cost, decode_token_cost)
        return max(work, 0.0) / (end - start)

    def served_since(
        self, node_id: str, start: float, prefill_token_cost: float, decode_token_cost: float
    ) -> float | None:
        """Work per second the member served from ``start`` to its newest report (None before one comes)."""
        last = self.latest(node_id)
        if last is None or not last.at > start:
            return None
        return self.served(node_id, start, last.at, last.at, prefill_token_cost, decode_token_cost)


def max_over_mean(loads: Iterable[float]) -> float:
    """max / mean (1.0 when empty or all zero)."""
    values = list(loads)
    total = math.fsum(values)
    return max(values) / (total / len(values)) if values and total > 0 else 1.0


@dataclass(frozen=True)
class PlanScore:
    """One plan's expected load per destination against what each served while the plan was in force, in the
    plan's work unit (per second)."""

    epoch: int
    planner_id: str
    start: float  # the plan's creation (planner's clock)
    end: float  # the next plan's creation
    expected: Mapping[str, float]
    served: Mapping[str, float]
    expected_imbalance: float  # the plan's own figure (``Plan.imbalance``): its expected loads' max/mean
    #: What the plan predicts one period of this length serves (``Plan.period_imbalance``): its expected loads plus
    #: the chance of a period's arrivals. The served max/mean scatters around this figure, not the one above.
    period_imbalance: float

    @property
    def served_imbalance(self) -> float:
        return max_over_mean(self.served.values())

    @property
    def error(self) -> float:
        """served - predicted max/mean of the period: > 0 when the plan thought itself better balanced than it was."""
        return self.served_imbalance - self.period_imbalance

    @property
    def expected_total(self) -> float:
        return math.fsum(self.expected.values())

    @property
    def served_total(self) -> float:
        return math.fsum(self.served.values())


def score(plan: Plan, end: float, history: ServedHistory, now: float) -> PlanScore | None:
    """``plan`` scored against what its destinations served from its creation to ``end`` (the next plan's
    creation); None while some destination's figures for that window are not known."""
    served: dict[str, float] = {}
    for node_id in plan.dest_load:
        load = history.served(node_id, plan.created_at, end, now, plan.prefill_token_cost, plan.decode_token_cost)
        if load is None:
            return None
        served[node_id] = load
    return PlanScore(
        plan.epoch, plan.planner_id, plan.created_at, end, plan.expected_loads(), served, plan.imbalance(),
        plan.period_imbalance(end - plan.created_at),
    )
