"""Keeping one CacheRoute plan across the mesh with no coordinator, over the gossip agent.

Every node:
- counts the requests it routes per routing key, each once it has been served, with the work its engine reported
  (``work.py``), in a decayed heavy-hitter sketch (``rates.py``), and publishes its top keys under ``rates/top`` once
  per plan period;
- reads every member's served work from the loads gossip carries (``served.py``) and scores each plan it followed
  against what the destinations served while it was in force (``last_score``: status and metrics show it);
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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from p2pnode.config import DEFAULT_SCORES_PENDING
from p2pnode.gossip.agent import GossipAgent
from p2pnode.load import LOAD_KEY, decode_load
from p2pnode.plan.gate import ShadowGate
from p2pnode.plan.plan import GateReport, Plan, PlanChurn, churn, decode_plan, encode_plan, newer
from p2pnode.plan.planner import PlanConfig, build_plan, choose_planner, next_epoch, plan_due
from p2pnode.plan.rates import RATES_KEY, RATES_PREFIX, RateSketch, RateSummary, decode_summary, encode_summary
from p2pnode.plan.served import PlanScore, ServedHistory, score
from p2pnode.plan.work import ServedWork

log = logging.getLogger("p2pnode.plan")

#: Where a node publishes the plan it built.
PLAN_GOSSIP_KEY = f"{RATES_PREFIX}plan"
#: Plan periods the served-work history spans at least (a plan is scored a period and a few seconds after it ends).
SERVED_SPAN_PERIODS = 4


#: Epochs at or above this are refused: one a plan a second takes 146 billion years to reach.
MAX_PLAN_EPOCH = 1 << 62


@dataclass
class PlanSyncStats:
    plans_built: int = 0
    plans_adopted: int = 0
    plans_ignored_older: int = 0
    malformed: int = 0
    #: Plans a member published as another planner's, or with an epoch no honest planner reaches: ignored.
    plans_forged: int = 0
    last_churn: PlanChurn | None = None
    plans_scored: int = 0
    plans_unscored: int = 0  # dropped before their destinations' figures were known (a member gone, a long stall)
    #: Sum of |served - expected max/mean| over the plans scored.
    imbalance_error_sum: float = 0.0
    last_score: PlanScore | None = None


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
        #: Every member's served work, from the loads gossip carries.
        self.served = ServedHistory()
        #: Plans followed and replaced, with the end of their time in force, waiting for their score (oldest first).
        self._to_score: deque[tuple[Plan, float]] = deque(maxlen=DEFAULT_SCORES_PENDING)
        self._last_publish = float("-inf")
        self._started: float | None = None
        #: When this node took the plan in force, on its own clock (``plan_due``).
        self._plan_held_since = 0.0
        agent.watch(PLAN_GOSSIP_KEY, self._on_plan_key)

    def routed(self, block_hashes: tuple[int, ...], prompt_tokens: int, max_tokens: int) -> None:
        """Log one routed request for the gate's replay (called once per request by the ingress, when routing)."""
        if self.gate is not None:
            self.gate.log.record(self.clock(), block_hashes, prompt_tokens, max_tokens)

    def served_request(self, key: str, work: ServedWork) -> None:
        """Count one request this node routed, once served, with the work its engine reported."""
        self.sketch.observe(key, self.clock(), work.prompt_tokens, work.cached_tokens, work.completion_tokens)

    def _on_plan_key(self, node_id: str, key: str, value: bytes | None) -> None:
        if value is None or key != PLAN_GOSSIP_KEY:
            return
        try:
            plan = decode_plan(value)
        except ValueError:
            self.stats.malformed += 1
            log.warning("ignoring a malformed plan published by %s", node_id)
            return
        if plan.planner_id != node_id or plan.epoch >= MAX_PLAN_EPOCH:
            # a plan is its planner's own key: one published under another name, or so far ahead that no planner
            # could follow it (the next epoch past 2**64), would stop the mesh's planning for good
            self.stats.plans_forged += 1
            log.warning("ignoring a plan %s published as %s's (epoch %d)", node_id, plan.planner_id, plan.epoch)
            return
        self._adopt(plan)

    def _adopt(self, plan: Plan) -> None:
        if self.plan is not None and not newer(plan, self.plan):
            if plan.epoch < self.plan.epoch:
                self.stats.plans_ignored_older += 1
            return
        if self.plan is not None:
            self.stats.last_churn = churn(self.plan, plan)
            if plan.created_at > self.plan.created_at:
                if len(self._to_score) == self._to_score.maxlen:
                    self.stats.plans_unscored += 1
                self._to_score.append((self.plan, plan.created_at))
        if self.plan is None or (self.plan.planner_id, self.plan.affinity) != (plan.planner_id, plan.affinity):
            # logged when the planner or the affinity changes, not every period
            log.info(
                "plan: following %s's plan (epoch %d, %d warm keys), affinity %s",
                plan.planner_id, plan.epoch, len(plan.assignments), "on" if plan.affinity else "off",
            )  # fmt: skip
        self.plan = plan
        self._plan_held_since = self.clock()
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

    def _read_served(self, alive: list[str], now: float) -> None:
        """Every live member's served work from its gossiped load, then the plans whose figures are now known."""
        period = self.plan.period_s if self.plan is not None else self.config.period_s
        spacing = SERVED_SPAN_PERIODS * period / self.served.max_samples
        for node_id, keys in self.agent.read(LOAD_KEY).items():
            value = keys.get(LOAD_KEY)
            load = decode_load(value) if value is not None else None
            if load is not None:
                self.served.record(node_id, load, spacing)
        self.served.retain(alive)
        while self._to_score:
            plan, end = self._to_score[0]
            result = score(plan, end, self.served, now)
            if result is None:
                if now - end < self.served.settle_s + 2 * plan.period_s:
                    return
                self.stats.plans_unscored += 1  # a destination's figures never came: left, or restarted
            else:
                self.stats.plans_scored += 1
                self.stats.imbalance_error_sum += abs(result.error)
                self.stats.last_score = result
            self._to_score.popleft()

    def tick(self) -> None:
        """Once a second or so: publish rates every period; score plans; build and publish a plan when this node is
        the planner."""
        now = self.clock()
        if self._started is None:
            self._started = now
        if now - self._last_publish >= self.config.period_s:
            self._last_publish = now
            self.agent.publish(RATES_KEY, encode_summary(self.sketch.summary(now)))
        alive = self.alive_ids()
        self._read_served(alive, now)
        if not alive or choose_planner(alive) != self.agent.self_id:
            return
        if self.gate is not None:
            in_force = self.verdict()
            self.gate.poll(now, len(alive), currently_on=in_force is not None and in_force.enabled)
        if self.plan is None and now - self._started < self.config.period_s:
            return  # a node that just (re)started hears the mesh's plan first: it plans on from it, not from scratch
        if not plan_due(self.plan, now, self.config, self._plan_held_since):
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
