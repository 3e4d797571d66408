"""The plan hook: every plan period the simulator hands the mesh's per-key rates to a ``PlanProvider``, and passes
the object it returns to the routing policy as its third argument (``policy(request, peers, plan)``).

What the node does (issue 5), and the simulator with it: each ingress counts arrivals per routing key in the real
``p2pnode.routing.rates.RateSketch`` (rate, uncached prompt tokens, decode tokens, with time decay); every plan
period the planner merges every node's ``RateSummary`` and builds a ``Plan`` with the real
``p2pnode.routing.planner.build_plan`` (warm set with hysteresis, k_b, LPT placement; the previous plan drives the
stickiness), the planner being ``choose_planner`` of the live members. Not modelled: the gossip delay of the rate
summaries and of the plan (every router gets the new plan at once) and the shadow-replay gate (``Plan.affinity``
stays on).

The sketch is fed at routing time with the router's estimate of the cached tokens at the chosen node (the
engine's count is not known yet), as ``RateSketch.observe`` allows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from p2pnode.routing.plan import Plan
from p2pnode.routing.planner import DEFAULT_PLAN_PERIOD_S, PlanConfig, build_plan, choose_planner, next_epoch
from p2pnode.routing.rates import RateSummary

__all__ = [
    "PLAN_POLICIES",
    "CacheRoutePlanner",
    "PlanInput",
    "PlanProvider",
    "cacheroute_available",
    "provider_for",
]

#: Policies that route by a plan, and the fallback their cold keys follow (see policies/cacheroute.py).
PLAN_POLICIES = {"cacheroute": None, "cacheroute-p2p": "p2p"}


@dataclass(frozen=True)
class PlanInput:
    """What a planner is given each period."""

    now: float
    node_ids: tuple[str, ...]
    rates: tuple[RateSummary, ...]  # one per node, as each would publish it
    previous: object | None
    loads: tuple[tuple[int, int], ...]  # per node: (running, waiting) right now


class PlanProvider(Protocol):
    period_s: float

    def plan(self, inp: PlanInput) -> object | None: ...


class CacheRoutePlanner:
    """``build_plan`` over the nodes' rate summaries, by the planner ``choose_planner`` designates."""

    def __init__(self, config: PlanConfig | None = None) -> None:
        self.config = config or PlanConfig()
        self.period_s = self.config.period_s

    def plan(self, inp: PlanInput) -> Plan:
        previous = inp.previous if isinstance(inp.previous, Plan) else None
        return build_plan(
            inp.rates,
            inp.node_ids,
            previous,
            self.config,
            next_epoch(previous),
            choose_planner(inp.node_ids),
            inp.now,
        )


def cacheroute_available() -> bool:
    """Whether the CacheRoute policy is registered (its planner is imported above)."""
    from p2pnode.routing.policies import POLICIES

    return "cacheroute" in POLICIES


def provider_for(
    policy: str, decode_token_cost: float | None = None, period_s: float = DEFAULT_PLAN_PERIOD_S
) -> PlanProvider | None:
    """The plan provider ``policy`` needs (None for the plan-less policies)."""
    if policy not in PLAN_POLICIES:
        return None
    kw = {} if decode_token_cost is None else {"decode_token_cost": decode_token_cost}
    return CacheRoutePlanner(PlanConfig(period_s=period_s, **kw))
