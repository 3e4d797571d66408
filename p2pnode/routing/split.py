"""The plan's split, as one ingress realises it: how many requests of each warm key it sent to each of the key's
destinations under the plan in force.

Why: the plan gives a hot key k_b destinations, each planned to carry an equal piece of the key's load (LPT places
k_b pieces of ``load / k_b``). Ranking a key's destinations by prefix match would send everything to whichever
cached the key first, until it queued; with short requests it never does, and one destination takes the whole key
(seen on a live mesh: 434 of 434 requests). So every ingress keeps its own count per (key, destination) and the
``cacheroute`` policy sends each request to a destination still below its share (``RouteRequest.plan_sends``):
without any coordination, every ingress's traffic, and so the mesh's, splits by the plan's shares -- as the policy
leans them on the destinations' recent served work (``cacheroute.fill_shares``), the same at every ingress.

Invariants: counts are for one plan (epoch and planner); a newer plan starts them afresh. Only warm keys of the
plan in force are counted, so the counts are bounded by the plan's size (its warm set and k_b).
"""

from __future__ import annotations

from collections.abc import Mapping

from p2pnode.plan.plan import Plan

__all__ = ["PlanSplit"]


class PlanSplit:
    """Sends per warm key and destination under the plan in force (module docstring)."""

    __slots__ = ("_plan", "_sent")

    def __init__(self) -> None:
        self._plan: tuple[int, str] | None = None  # (epoch, planner) the counts are for
        self._sent: dict[str, dict[str, int]] = {}

    def _for(self, plan: Plan) -> dict[str, dict[str, int]]:
        ident = (plan.epoch, plan.planner_id)
        if ident != self._plan:
            self._plan = ident
            self._sent = {}
        return self._sent

    def sends(self, plan: Plan, key: str) -> Mapping[str, int]:
        """This ingress's sends of ``key`` to each destination under ``plan`` (empty: none yet)."""
        return self._for(plan).get(key, {})

    def record(self, plan: Plan, key: str, destination: str) -> None:
        """A request of ``key`` went to ``destination``; counted when ``key`` is warm in ``plan``."""
        if destination in plan.destinations(key):
            per_key = self._for(plan).setdefault(key, {})
            per_key[destination] = per_key.get(destination, 0) + 1

    def observed(self, plan: Plan | None) -> dict[str, dict[str, int]]:
        """Every warm key's counts under ``plan`` (for status)."""
        return {} if plan is None else {k: dict(v) for k, v in self._for(plan).items()}
