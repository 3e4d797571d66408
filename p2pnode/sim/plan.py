"""The plan hook: every plan period the simulator hands the mesh's per-key rates to a ``PlanProvider``, and passes
the object it returns to the routing policy as its third argument (``policy(request, peers, plan)``).

What the node does, and the simulator with it: each ingress counts arrivals per routing key in the real
``p2pnode.plan.rates.RateSketch`` (rate, uncached prompt tokens, decode tokens, with time decay); every plan
period the planner merges every node's ``RateSummary`` and builds a ``Plan`` with the real
``p2pnode.plan.planner.build_plan`` (warm set with hysteresis, k_b, LPT placement; the previous plan drives the
stickiness), the planner being ``choose_planner`` of the live members. Not modelled: the gossip delay of the rate
summaries and of the plan (every router gets the new plan at once) and the shadow-replay gate (``Plan.affinity``
stays on).

The sketch counts each request when it finishes, with its served work -- the engine's cached tokens and the
tokens it generated (``p2pnode/plan/work.py``) -- at the ingress that routed it, as a node counts; a dropped request
served nothing and is not counted.

Policy names (``--policies``): ``cacheroute`` (the policy's ``DEFAULT_FALLBACK`` for cold keys),
``cacheroute-flat``, ``cacheroute-p2p``, ``cacheroute-chwbl`` (an explicit fallback), each optionally followed by
planner overrides for what-if runs: ``@k<top_k>`` and ``@r<min_rate>``, e.g. ``cacheroute-chwbl@k512@r0.02``
(warm set of at most 512 keys, admission at 0.02 req/s); the policy's spec carries them (``PolicySpec.planner``).
Everything else keeps ``PlanConfig``'s defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from p2pnode.plan.plan import Plan
from p2pnode.plan.planner import DEFAULT_PLAN_PERIOD_S, PlanConfig, build_plan, choose_planner, next_epoch
from p2pnode.plan.rates import RateSummary
from p2pnode.routing.policies.spec import PolicySpec

__all__ = ["CacheRoutePlanner", "PlanInput", "PlanProvider", "provider_for"]

@dataclass(frozen=True)
class PlanInput:
    """What a planner is given each period."""

    now: float
    node_ids: tuple[str, ...]
    rates: tuple[RateSummary, ...]  # one per node, as each would publish it
    previous: Plan | None
    loads: tuple[tuple[int, int], ...]  # per node: (running, waiting) right now


class PlanProvider(Protocol):
    period_s: float

    def plan(self, inp: PlanInput) -> Plan | None: ...


class CacheRoutePlanner:
    """``build_plan`` over the nodes' rate summaries, by the planner ``choose_planner`` designates."""

    def __init__(self, config: PlanConfig | None = None) -> None:
        self.config = config or PlanConfig()
        self.period_s = self.config.period_s

    def plan(self, inp: PlanInput) -> Plan:
        previous = inp.previous
        return build_plan(
            inp.rates,
            inp.node_ids,
            previous,
            self.config,
            next_epoch(previous),
            choose_planner(inp.node_ids),
            inp.now,
        )


def provider_for(
    spec: PolicySpec, decode_token_cost: float | None = None, period_s: float = DEFAULT_PLAN_PERIOD_S
) -> PlanProvider | None:
    """The plan provider the policy needs (None for a policy that does not route by a plan), with the planner
    what-ifs its spec carries (``PolicySpec.planner``: ``cacheroute@k512`` sets ``top_k``)."""
    if not spec.reads.plan:
        return None
    kw: dict[str, Any] = dict(spec.planner)
    if decode_token_cost is not None:
        kw["decode_token_cost"] = decode_token_cost
    return CacheRoutePlanner(PlanConfig(period_s=period_s, **kw))
