"""The plan hook: every plan period the simulator hands the mesh's per-key rates to a ``PlanProvider``, and passes
the object it returns to the routing policy as its third argument (``policy(request, peers, plan)``).

What the node does, and the simulator with it: each ingress counts arrivals per routing key in the real
``p2pnode.plan.rates.RateSketch`` (rate, uncached prompt tokens, decode tokens, with time decay); every plan
period the planner merges every node's ``RateSummary`` and builds a ``Plan`` with the real
``p2pnode.plan.planner.build_plan`` (warm set with hysteresis, k_b, LPT placement; the previous plan drives the
stickiness), the planner being ``choose_planner`` of the live members. Not modelled: the gossip delay of the rate
summaries and of the plan (every router gets the new plan at once) and the shadow-replay gate (``Plan.affinity``
stays on).

The sketch is fed at routing time with the router's estimate of the cached tokens at the chosen node (the
engine's count is not known yet), as ``RateSketch.observe`` allows.

Policy names (``--policies``): ``cacheroute`` (the policy's ``DEFAULT_FALLBACK`` for cold keys),
``cacheroute-flat``, ``cacheroute-p2p``, ``cacheroute-chwbl`` (an explicit fallback), each optionally followed by
planner overrides for what-if runs: ``@k<top_k>`` and ``@r<min_rate>``, e.g. ``cacheroute-chwbl@k512@r0.02``
(warm set of at most 512 keys, admission at 0.02 req/s). Everything else keeps ``PlanConfig``'s defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from p2pnode.plan.plan import Plan
from p2pnode.plan.planner import DEFAULT_PLAN_PERIOD_S, PlanConfig, build_plan, choose_planner, next_epoch
from p2pnode.plan.rates import RateSummary

__all__ = [
    "PLAN_POLICIES",
    "CacheRoutePlanner",
    "PlanInput",
    "PlanProvider",
    "cacheroute_available",
    "parse_plan_policy",
    "provider_for",
]

#: Base names of the policies that route by a plan, and the fallback their cold keys follow (None: the policy's
#: ``DEFAULT_FALLBACK``; see policies/cacheroute.py).
_BASE_PLAN_POLICIES: dict[str, str | None] = {
    "cacheroute": None,
    "cacheroute-flat": "flat",
    "cacheroute-p2p": "p2p",
    "cacheroute-chwbl": "chwbl",
}
#: Planner overrides a policy name may carry after its base name: ``@k<int>`` top_k, ``@r<float>`` min_rate.
_OVERRIDES = {"k": ("top_k", int), "r": ("min_rate", float)}


def parse_plan_policy(name: str) -> tuple[str | None, dict[str, Any]] | None:
    """(fallback or None, PlanConfig overrides) for a plan policy name; None for any other name.

    ValueError for a plan policy name with a malformed or repeated override.
    """
    base, *mods = name.split("@")
    if base not in _BASE_PLAN_POLICIES:
        return None
    overrides: dict[str, Any] = {}
    for mod in mods:
        field, conv = _OVERRIDES.get(mod[:1], (None, None))
        if field is None or conv is None or field in overrides:
            raise ValueError(f"bad plan policy override {mod!r} in {name!r}: expected @k<top_k> or @r<min_rate>")
        try:
            overrides[field] = conv(mod[1:])
        except ValueError:
            raise ValueError(
                f"bad plan policy override {mod!r} in {name!r}: expected @k<top_k> or @r<min_rate>"
            ) from None
    return _BASE_PLAN_POLICIES[base], overrides


class _PlanPolicies(dict[str, str | None]):
    """``name in PLAN_POLICIES`` and ``PLAN_POLICIES[name]`` (its fallback) for every plan policy name, overrides
    included (a name with overrides maps to an explicit fallback, so the simulator binds it like ``cacheroute-p2p``).
    """

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and parse_plan_policy(name) is not None

    def __getitem__(self, name: str) -> str | None:
        parsed = parse_plan_policy(name)
        if parsed is None:
            raise KeyError(name)
        fallback, overrides = parsed
        if fallback is None and overrides:
            from p2pnode.routing.policies.cacheroute import DEFAULT_FALLBACK

            return DEFAULT_FALLBACK
        return fallback

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        try:
            return self[name]
        except KeyError:
            return default


#: Policies that route by a plan (the base names are listed; ``@k``/``@r`` variants are accepted too), and the
#: fallback their cold keys follow.
PLAN_POLICIES = _PlanPolicies(_BASE_PLAN_POLICIES)


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


def cacheroute_available() -> bool:
    """Whether the CacheRoute policy is registered (its planner is imported above)."""
    from p2pnode.routing.policies import POLICIES

    return "cacheroute" in POLICIES


def provider_for(
    policy: str, decode_token_cost: float | None = None, period_s: float = DEFAULT_PLAN_PERIOD_S
) -> PlanProvider | None:
    """The plan provider ``policy`` needs (None for the plan-less policies)."""
    parsed = parse_plan_policy(policy)
    if parsed is None:
        return None
    kw: dict[str, Any] = dict(parsed[1])
    if decode_token_cost is not None:
        kw["decode_token_cost"] = decode_token_cost
    return CacheRoutePlanner(PlanConfig(period_s=period_s, **kw))
