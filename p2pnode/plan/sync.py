"""Keeping one CacheRoute plan across the mesh with no coordinator, over the gossip agent.

Every node:
- counts the requests it routes per routing key in a decayed heavy-hitter sketch (``rates.py``) and publishes its
  top keys under ``rates/top`` once per plan period;
- watches every node's ``rates/plan`` key and adopts a plan only when it is ``newer`` (epoch, then planner id)
  than the one it uses, so an older epoch never replaces a newer one and a dead planner's plan keeps working
  until a newer one arrives.

The planner is ``choose_planner(alive members)`` — the smallest live id — so when it dies, gossip's failure
detector removes it from the live set and the next node takes over at its next tick, with the next epoch. Only
the planner builds plans: it merges every live node's published rates, runs ``build_plan`` over the live nodes as
destinations, and publishes the result under its own ``rates/plan`` — with ``affinity`` set by the shadow-replay
gate (``gate.py``): off until a replay of recent traffic predicts that pinning warm keys pays. The verdict travels in
the plan, so a new planner carries the mesh's verdict forward until its own replay decides (``verdict``), and a node
that just (re)started waits a plan period to hear the mesh's plan before planning.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from p2pnode.gossip.agent import GossipAgent
from p2pnode.plan.gate import ShadowGate
from p2pnode.plan.plan import GateReport, Plan, PlanChurn, churn, decode_plan, encode_plan, newer
from p2pnode.plan.planner import PlanConfig, build_plan, choose_planner, next_epoch, plan_due
from p2pnode.plan.rates import RATES_KEY, RATES_PREFIX, RateSketch, RateSummary, decode_summary, encode_summary

log = logging.getLogger("p2pnode.plan")

#: Where a node publishes the plan it built.
PLAN_GOSSIP_KEY = f"{RATES_PREFIX}plan"


@dataclass
class PlanSyncStats:
    plans_built: int = 0
    plans_adopted: int = 0
    plans_ignored_older: int = 0
    malformed: int = 0
    last_churn: PlanChurn | None = None


class PlanSync:
    """One node's share of the rate plan: its rates out, the newest plan in, and planning when elected."""

    def __init__(
        self,
        agent: GossipAgent,
        on_plan: Callable[[Plan], None],
        config: PlanConfig | None = None,
        *,
        sketch: RateSketch | None = None,
        gate: ShadowGate | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.agent = agent
        self.on_plan = on_plan
        self.config = config or PlanConfig()
        self.sketch = sketch or RateSketch()
        #: None: affinity always on (no gate); else the gate's latest verdict decides.
        self.gate = gate
        self.clock = clock
        self.plan: Plan | None = None
        self.stats = PlanSyncStats()
        self._last_publish = float("-inf")
        self._started: float | None = None
        agent.watch(PLAN_GOSSIP_KEY, self._on_plan_key)

    def observe(
        self, key: str, block_hashes: tuple[int, ...], prompt_tokens: int, cached_tokens: int, max_tokens: int
    ) -> None:
        """Count one routed request (called once per request by the ingress) and log it for the gate."""
        now = self.clock()
        self.sketch.observe(key, now, prompt_tokens, cached_tokens, max_tokens)
        if self.gate is not None:
            self.gate.log.record(now, block_hashes, prompt_tokens, max_tokens)

    def _on_plan_key(self, node_id: str, key: str, value: bytes | None) -> None:
        if value is None or key != PLAN_GOSSIP_KEY:
            return
        try:
            plan = decode_plan(value)
        except ValueError:
            self.stats.malformed += 1
            log.warning("ignoring a malformed plan published by %s", node_id)
            return
        self._adopt(plan)

    def _adopt(self, plan: Plan) -> None:
        if self.plan is not None and not newer(plan, self.plan):
            if plan.epoch < self.plan.epoch:
                self.stats.plans_ignored_older += 1
            return
        if self.plan is not None:
            self.stats.last_churn = churn(self.plan, plan)
        if self.plan is None or (self.plan.planner_id, self.plan.affinity) != (plan.planner_id, plan.affinity):
            # logged when the planner or the affinity changes, not every period
            log.info(
                "plan: following %s's plan (epoch %d, %d warm keys), affinity %s",
                plan.planner_id, plan.epoch, len(plan.assignments), "on" if plan.affinity else "off",
            )  # fmt: skip
        self.plan = plan
        self.stats.plans_adopted += 1
        self.on_plan(plan)

    def verdict(self) -> GateReport | None:
        """The gate verdict a plan built now follows: the newest of this node's own replay and the verdict of the plan
        in force -- so a new planner, whose gate has no evidence yet, keeps the mesh's verdict (and affinity) until
        its own replay decides, and an ex-planner's stale verdict never overrides a newer one."""
        own = self.gate.report if self.gate is not None else None
        held = self.plan.verdict if self.plan is not None else None
        if own is None or (held is not None and held.at > own.at):
            return held
        return own

    def alive_ids(self) -> list[str]:
        return self.agent.usable_ids()

    def planner_id(self) -> str:
        return choose_planner(self.alive_ids())

    def tick(self) -> None:
        """Once a second or so: publish rates every period; build and publish a plan when this node is the planner."""
        now = self.clock()
        if self._started is None:
            self._started = now
        if now - self._last_publish >= self.config.period_s:
            self._last_publish = now
            self.agent.publish(RATES_KEY, encode_summary(self.sketch.summary(now)))
        alive = self.alive_ids()
        if not alive or choose_planner(alive) != self.agent.self_id:
            return
        if self.gate is not None:
            in_force = self.verdict()
            self.gate.poll(now, len(alive), currently_on=in_force is not None and in_force.enabled)
        if self.plan is None and now - self._started < self.config.period_s:
            return  # a node that just (re)started hears the mesh's plan first: it plans on from it, not from scratch
        if not plan_due(self.plan, now, self.config):
            return
        summaries: list[RateSummary] = []
        for node_id, keys in sorted(self.agent.read(RATES_PREFIX).items()):
            data = keys.get(RATES_KEY)
            if data is None:
                continue
            try:
                summaries.append(decode_summary(data))
            except ValueError:
                self.stats.malformed += 1
                log.warning("ignoring malformed rates published by %s", node_id)
        plan = build_plan(
            summaries, alive, self.plan, self.config, next_epoch(self.plan), self.agent.self_id, now
        )
        if self.gate is not None:
            verdict = self.verdict()
            plan = dataclasses.replace(plan, affinity=verdict is not None and verdict.enabled, verdict=verdict)
        self.stats.plans_built += 1
        self.agent.publish(PLAN_GOSSIP_KEY, encode_plan(plan))
        self._adopt(plan)
