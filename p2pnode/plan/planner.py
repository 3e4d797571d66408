"""The CacheRoute-style planner: from the mesh's merged key rates to a ``Plan`` (warm set, k_b, LPT placement).

Why a plan: longest-prefix affinity alone sends a hot prefix's whole load to the one node holding it (CacheRoute's
ablation: 88% KV hit at 3.46x load imbalance). Planning keeps the affinity of the hot keys while bounding each
destination's expected load: hot keys are pinned to destinations chosen by their *expected load*, and a key too
big for one destination is split over several.

Steps of ``build_plan`` (every one deterministic: same inputs, in any order, give the same plan on every node):

1. **Merge** every node's published ``RateSummary`` (rates add; ``rates.merge_summaries``).
2. **Admit with hysteresis** (a stable warm set keeps caches warm): rank keys by merged rate (ties by key).
   A key of the previous plan stays while it ranks within ``top_k * (1 + hysteresis)`` and its rate is at least
   ``min_rate / (1 + hysteresis)``; a new key enters when it ranks within ``top_k``, its *guaranteed* rate
   (rate - sketch error) is at least ``min_rate`` and a slot is free, or when its rate beats the weakest incumbent's
   by the factor ``1 + hysteresis`` (it then takes that slot). The warm set never exceeds ``top_k``.
3. **Expected load** per key: ``rate * (uncached_tokens * prefill_token_cost + decode_tokens * decode_token_cost)``
   in prefill-token units per second (the work unit, ``work.py``), with the uncached tokens of the key's requests
   while its prefix is resident where they are served (``KeyRate.resident_work``): a warm key stays on its
   destinations, so its misses -- its first requests, a move -- are transients, counted below as one prefix build
   per new destination, not spread over every request for minutes. One destination's share is ``q_cap =
   q_cap_factor * total load / destinations``, with the total over *all* traffic: the warm keys' resident loads
   plus the rest of what the summaries' totals say was served.
4. **k_b**: a key whose load exceeds q_cap gets ``k_b = ceil(load / q_cap)`` destinations (at most ``max_kb`` and
   the number of destinations), each carrying ``load / k_b``. Hysteresis again: k_b shrinks only once the load
   fits ``(k_b - 1) * (1 - hysteresis)`` shares, so a key near a boundary does not flap. And a **hold**: once a key
   needs k >= 2 destinations, no plan within ``kb_hold_s`` gives it fewer while its rate stays at or above
   ``(1 - hysteresis)`` x its rate then (``plan.KbHold``, carried in the plan): a whale warming up reads as below
   two shares for a while (its misses turn into hits, and so do the other keys'), and a Poisson dip is not a
   cooling key.
5. **LPT placement** (Graham's longest-processing-time rule): keys by piece load (``load / k_b``), largest
   first; each of a key's k_b pieces goes to the least-loaded destination not already holding that key (ties:
   the least load that later keys are expected to keep there, then node id). To limit churn, a piece stays on
   one of its key's previous destinations as long as that keeps the destination's warm load within
   ``(1 + stickiness)`` x the mean *total* load per destination (warm and cold: cold keys follow a
   load-balancing fallback that fills the valleys) -- a fixed reference, so stickiness can never compound into
   imbalance; the max warm load is at most ``max((1 + stickiness) * mean, LPT's bound)``.
6. **Builds**: a destination new to a key builds its prefix (``prefix_tokens``) once, when the key first arrives
   there: ``prefix_tokens * prefill_token_cost * P(an arrival within the period) / period`` is added to that
   destination's expected load for this plan, so that the plan's expected loads -- what it is scored against
   (``served.py``) -- include the cost of its own moves.
7. **Fit** the plan into its gossip byte budget: if the encoded plan is too large (very long ids), the
   lowest-load keys are dropped until it fits.

Failover without election: ``choose_planner`` picks the smallest live node id. Every node computes it from its own
membership view; when the planner dies, the gossip failure detector removes it and the next-smallest id takes over
at its next tick, numbering its plan ``next_epoch`` (one above the newest plan it holds). Until then the old plan
keeps routing (``plan.newer``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass

from p2pnode.config import (
    DEFAULT_DECODE_TOKEN_COST,
    DEFAULT_HYSTERESIS,
    DEFAULT_KB_HOLD_S,
    DEFAULT_MAX_KB,
    DEFAULT_MIN_RATE,
    DEFAULT_PLAN_PERIOD_S,
    DEFAULT_PREFILL_TOKEN_COST,
    DEFAULT_Q_CAP_FACTOR,
    DEFAULT_STICKINESS,
    DEFAULT_TOP_K,
    PlanConfig,
)
from p2pnode.plan.plan import KbHold, Plan, encode_plan
from p2pnode.plan.rates import KeyRate, RateSummary, merge_summaries

__all__ = [
    "DEFAULT_DECODE_TOKEN_COST",
    "DEFAULT_HYSTERESIS",
    "DEFAULT_KB_HOLD_S",
    "DEFAULT_MAX_KB",
    "DEFAULT_MIN_RATE",
    "DEFAULT_PLAN_PERIOD_S",
    "DEFAULT_PREFILL_TOKEN_COST",
    "DEFAULT_Q_CAP_FACTOR",
    "DEFAULT_STICKINESS",
    "DEFAULT_TOP_K",
    "PlanConfig",
    "admit",
    "build_plan",
    "choose_planner",
    "next_epoch",
    "plan_due",
]


_EPS = 1e-9


def choose_planner(alive_member_ids: Iterable[str]) -> str:
    """The planner among the live members: the smallest id. No election: every node derives it from its own view.

    Two nodes whose views differ for a moment may both plan; ``plan.newer`` orders their plans, so every router
    still converges on one. ValueError when nobody is alive.
    """
    try:
        return min(alive_member_ids)
    except ValueError:
        raise ValueError("no live member to plan") from None


def next_epoch(previous: Plan | None) -> int:
    """The epoch of the next plan: one above the newest plan this node holds (1 for the first)."""
    return 1 if previous is None else previous.epoch + 1


def plan_due(previous: Plan | None, now: float, config: PlanConfig, held_since: float | None = None) -> bool:
    """Whether the planner should publish a new plan at ``now`` (no plan yet, or the period has passed). With
    ``held_since`` (when this node took the plan, on its own clock) the period runs from then: the plan's
    ``created_at`` is its planner's clock, and a planner whose clock ran an hour ahead, then died, left a plan no
    successor found due for an hour."""
    if previous is None:
        return True
    start = previous.created_at if held_since is None else min(previous.created_at, held_since)
    return now - start >= config.period_s


def admit(ranked: list[KeyRate], previous: Plan | None, config: PlanConfig) -> list[KeyRate]:
    """The warm set (at most ``top_k`` keys, by rate descending) from keys ranked by rate; see step 2 above."""
    k, h = config.top_k, config.hysteresis
    if k == 0:
        return []
    keep_rank = math.ceil(k * (1 + h))
    prev = previous.assignments if previous is not None else {}
    retained = [kr for kr in ranked[:keep_rank] if kr.key in prev and kr.rate >= config.min_rate / (1 + h)][:k]
    newcomers = [kr for kr in ranked[:k] if kr.key not in prev and kr.rate - kr.error >= config.min_rate]
    free = k - len(retained)
    warm, waiting = retained + newcomers[:free], newcomers[free:]
    # Swaps: the strongest waiting newcomer replaces the weakest incumbent only by a (1+h) margin.
    weakest = len(retained) - 1
    for cand in waiting:
        if weakest < 0 or not cand.rate > (1 + h) * warm[weakest].rate:
            break
        warm[weakest] = cand
        weakest -= 1
    warm.sort(key=lambda kr: (-kr.rate, kr.key))
    return warm


def _kb(
    load: float, rate: float, q_cap: float, previous: Plan | None, key: str, cap: int, config: PlanConfig, now: float
) -> tuple[int, KbHold | None]:
    """The key's k_b and its hold in the new plan (step 4)."""
    h = config.hysteresis
    raw = load / q_cap if q_cap > 0 else 1.0
    needed = min(max(1, math.ceil(raw - _EPS)), cap)
    kb = needed
    prev_kb = previous.kb(key) if previous is not None else 0
    if prev_kb > 0 and kb < prev_kb and raw > (prev_kb - 1) * (1 - h):
        kb = prev_kb  # not yet clearly below the lower boundary: keep the previous count
    hold = previous.holds.get(key) if previous is not None else None
    if needed >= 2 and (hold is None or needed >= hold.kb):
        hold = KbHold(needed, float(now), rate)  # needs (at least) its held count now: the hold starts again
    elif hold is not None and not (now - hold.since < config.kb_hold_s and rate >= hold.rate * (1 - h)):
        hold = None  # held long enough, or its rate fell: the hysteresis above decides alone
    if hold is not None:
        kb = max(kb, hold.kb)
    kb = min(kb, cap)
    if hold is not None and hold.kb > kb:  # fewer destinations than when it was held: hold what there is
        hold = KbHold(kb, hold.since, hold.rate)
    return kb, (hold if hold is not None and hold.kb >= 2 else None)


def _place(
    keys: list[tuple[str, float, int]],
    dests: list[str],
    previous: Plan | None,
    ref: float,
) -> tuple[dict[str, tuple[str, ...]], dict[str, float]]:
    """LPT with stickiness over (key, load, k_b), in the given (largest piece first) order; see step 5 above.

    Each piece stays on one of its key's previous destinations while that keeps the destination's placed load
    within ``ref``; otherwise it goes to the destination with the least placed load not already holding the key,
    ties broken by the least *reserved* load (the pieces that keys placed later are expected to keep there), then
    node id. The reservation tie-break sends a key that must move (off a dead node, a new piece of a growing whale)
    where few later keys will want to stay, so it displaces as few of them as possible.
    """
    placed = dict.fromkeys(dests, 0.0)
    previous_of, reserved = _reservations(keys, placed, previous)
    heap = [(0.0, reserved[d], d) for d in dests]  # lazy: stale when placed[d] or reserved[d] moved on
    heapq.heapify(heap)

    def update(d: str, dp: float, dr: float) -> None:
        placed[d] += dp
        reserved[d] += dr
        heapq.heappush(heap, (placed[d], reserved[d], d))

    out: dict[str, tuple[str, ...]] = {}
    for key, key_load, kb in keys:
        piece = key_load / kb
        chosen: list[str] = []
        for d in previous_of.get(key, ()):
            if placed[d] + piece <= ref * (1 + _EPS):
                chosen.append(d)
                update(d, piece, -piece)
            else:
                update(d, 0.0, -piece)
        while len(chosen) < kb:
            d = _least_loaded(heap, placed, reserved, chosen)
            chosen.append(d)
            update(d, piece, 0.0)
        out[key] = tuple(chosen)
    return out, _final_loads(keys, out, dests)


def _reservations(
    keys: list[tuple[str, float, int]], placed: dict[str, float], previous: Plan | None
) -> tuple[dict[str, list[str]], dict[str, float]]:
    """Each key's previous destinations still placeable (at most its k_b), and each destination's reserved load: the
    pieces of the keys whose previous destination it is (none without a previous plan)."""
    reserved = dict.fromkeys(placed, 0.0)
    previous_of: dict[str, list[str]] = {}
    if previous is not None:
        for key, key_load, kb in keys:
            mine = [d for d in previous.destinations(key) if d in placed][:kb]
            previous_of[key] = mine
            for d in mine:
                reserved[d] += key_load / kb
    return previous_of, reserved


def _least_loaded(
    heap: list[tuple[float, float, str]], placed: dict[str, float], reserved: dict[str, float], chosen: list[str]
) -> str:
    """Pops the destination with the least placed load, then reserved load, then id, that is not ``chosen`` already;
    entries whose loads moved on since they were pushed are stale and dropped, the chosen ones go back."""
    stash: list[tuple[float, float, str]] = []
    while True:
        entry = heapq.heappop(heap)
        d = entry[2]
        if placed[d] != entry[0] or reserved[d] != entry[1]:
            continue
        if d in chosen:
            stash.append(entry)
            continue
        break
    for e in stash:
        heapq.heappush(heap, e)
    return d


def _final_loads(
    keys: list[tuple[str, float, int]], assignments: dict[str, tuple[str, ...]], dests: list[str]
) -> dict[str, float]:
    """Each destination's placed load, exact: independent of the order the running sums were formed in."""
    pieces: dict[str, list[float]] = {d: [] for d in dests}
    for key, key_load, kb in keys:
        for d in assignments[key]:
            pieces[d].append(key_load / kb)
    return {d: math.fsum(p) for d, p in pieces.items()}


def build_plan(
    rates: Iterable[RateSummary],
    destinations: Iterable[str],
    previous: Plan | None,
    config: PlanConfig,
    epoch: int,
    planner_id: str,
    now: float,
) -> Plan:
    """The plan for ``destinations`` (the live serving nodes) from every node's published rates.

    Pure: the result depends only on the arguments (not on their order), so any node -- and the simulator --
    computes the same plan from the same inputs. ``previous`` (the newest plan held) drives the hysteresis and
    the stickiness; its destinations that are no longer in ``destinations`` are simply not reused.
    """
    dests = sorted(set(destinations))
    keep_rank = math.ceil(config.top_k * (1 + config.hysteresis))
    merged = merge_summaries(rates, top=keep_rank)
    pc, dc = config.prefill_token_cost, config.decode_token_cost
    if not dests:
        return Plan(epoch, planner_id, now, config.period_s, {}, {}, {}, 0.0, merged.total_work(pc, dc),
                    prefill_token_cost=pc, decode_token_cost=dc)
    ranked = list(merged.keys)  # merge_summaries orders keys by rate descending, ties by key
    warm = _WarmSet.of(admit(ranked, previous, config), merged, dests, previous, config, epoch, planner_id, now)
    plan = warm.plan(len(warm.loads), True)
    if _fits(plan, config.max_plan_bytes):
        return plan
    return _trimmed(warm, config.max_plan_bytes)


def _fits(plan: Plan, max_bytes: int) -> bool:
    """Whether the plan's encoding fits one gossip message of ``max_bytes``."""
    try:
        encode_plan(plan, max_bytes)
    except ValueError:
        return False
    return True


def _trimmed(warm: _WarmSet, max_bytes: int) -> Plan:
    """Step 7: the plan of the largest prefix of the warm keys (by load) that fits ``max_bytes``; if even the list of
    every destination does not fit, it lists only the destinations that carry keys (the others have load 0)."""
    all_dests = _fits(warm.plan(0, True), max_bytes)
    lo, hi = 0, len(warm.loads) + 1  # plan(lo) fits; plan(hi) does not (or is out of range)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits(warm.plan(mid, all_dests), max_bytes):
            lo = mid
        else:
            hi = mid
    plan = warm.plan(lo, all_dests)
    if not _fits(plan, max_bytes):
        raise ValueError(f"max_plan_bytes={max_bytes} cannot hold even an empty plan")
    return plan


@dataclass(frozen=True, slots=True)
class _WarmSet:
    """The admitted keys with their expected loads (step 3) and what they are placed against: every plan one build
    tries (``plan``: the whole warm set, or its largest keys when that does not fit, step 7) is made from these."""

    epoch: int
    planner_id: str
    now: float
    config: PlanConfig
    previous: Plan | None
    dests: list[str]
    #: (key, expected load), largest first, ties by key.
    loads: list[tuple[str, float]]
    rate_of: dict[str, float]
    prefix_of: dict[str, int]
    #: A key's work per request while its prefix is resident (``KeyRate.resident_work``).
    work_of: dict[str, float]
    #: The load of all traffic, warm and cold, and one destination's share of it (``q_cap``; ``ref``: stickiness's).
    total: float
    q_cap: float
    ref: float
    #: The most destinations a key may get (``max_kb``, and no more than there are).
    cap: int
    cold_request_work: float

    @classmethod
    def of(
        cls,
        warm: list[KeyRate],
        merged: RateSummary,
        dests: list[str],
        previous: Plan | None,
        config: PlanConfig,
        epoch: int,
        planner_id: str,
        now: float,
    ) -> _WarmSet:
        """Step 3 for the ``warm`` keys of the ``merged`` rates, over ``dests``."""
        pc, dc = config.prefill_token_cost, config.decode_token_cost
        rate_of = {kr.key: kr.rate for kr in warm}
        work_of = {kr.key: kr.resident_work(pc, dc) for kr in warm}
        loads = [(kr.key, kr.rate * work_of[kr.key]) for kr in warm]
        loads.sort(key=lambda kl: (-kl[1], kl[0]))
        warm_total = math.fsum(kl for _, kl in loads)
        cold = max(merged.total_work(pc, dc) - math.fsum(kr.rate * kr.work(pc, dc) for kr in warm), 0.0)
        cold_rate = merged.total_rate - math.fsum(rate_of.values())
        # A cold request's work (its share of the period's variance). When the warm set holds (nearly) every key, the
        # residue of the totals (rounding on the wire, float32) over a cold rate near 0 read as one enormous request
        # and predicted a period of 1.95 x the mean for a plan expecting 1.09: no request costs more than the
        # costliest key's.
        most = max((kr.work(pc, dc) for kr in merged.keys), default=0.0)
        total = warm_total + cold
        return cls(
            epoch=epoch,
            planner_id=planner_id,
            now=now,
            config=config,
            previous=previous,
            dests=dests,
            loads=loads,
            rate_of=rate_of,
            prefix_of={kr.key: kr.prefix_tokens for kr in warm},
            work_of=work_of,
            total=total,
            q_cap=config.q_cap_factor * total / len(dests),
            ref=(1 + config.stickiness) * total / len(dests),
            cap=min(config.max_kb, len(dests)),
            cold_request_work=min(cold / cold_rate, most) if cold > 0 and cold_rate > 0 else 0.0,
        )

    def plan(self, n: int, all_dests: bool) -> Plan:
        """The plan of the ``n`` largest warm keys (steps 4-6); ``all_dests``: it lists every destination, else only
        those that carry keys."""
        config, previous = self.config, self.previous
        items, holds = self._pieces(n)
        assignments, dest_load = _place(items, self.dests, previous, self.ref) if items else ({}, {})
        variance = self._add_builds(items, assignments, dest_load)
        if all_dests:
            dest_load = {d: dest_load.get(d, 0.0) for d in self.dests}
        else:
            dest_load = {d: dest_load[d] for ds in assignments.values() for d in ds}
        key_load = {key: kl for key, kl, _ in items}
        dest_var = {d: v for d, parts in variance.items() if d in dest_load and (v := math.fsum(parts)) > 0}
        return Plan(
            self.epoch,
            self.planner_id,
            self.now,
            config.period_s,
            assignments,
            key_load,
            dest_load,
            self.q_cap,
            self.total,
            prefill_token_cost=config.prefill_token_cost,
            decode_token_cost=config.decode_token_cost,
            holds=holds,
            dest_var=dest_var,
            cold_request_work=self.cold_request_work,
        )

    def _pieces(self, n: int) -> tuple[list[tuple[str, float, int]], dict[str, KbHold]]:
        """Step 4 for the ``n`` largest keys: each one's (key, load, k_b), largest piece first (LPT's jobs are the
        pieces), and the holds of those that carry one."""
        items: list[tuple[str, float, int]] = []
        holds: dict[str, KbHold] = {}
        for key, kl in self.loads[:n]:
            kb, hold = _kb(kl, self.rate_of[key], self.q_cap, self.previous, key, self.cap, self.config, self.now)
            items.append((key, kl, kb))
            if hold is not None:
                holds[key] = hold
        items.sort(key=lambda it: (-it[1] / it[2], it[0]))
        return items, holds

    def _add_builds(
        self,
        items: list[tuple[str, float, int]],
        assignments: dict[str, tuple[str, ...]],
        dest_load: dict[str, float],
    ) -> dict[str, list[float]]:
        """Step 6: adds to ``dest_load`` the prefixes its new destinations build for each key; returns each
        destination's variance parts (its pieces' Poisson arrivals, and the builds' chance of happening)."""
        previous, period_s = self.previous, self.config.period_s
        variance: dict[str, list[float]] = {d: [] for d in dest_load}
        for key, kl, kb in items:
            # A piece's requests: the key's Poisson arrivals, split evenly by every ingress (a 1/k_b share of them).
            piece_var = kl * self.work_of[key] / (kb * kb)
            new = [d for d in assignments[key] if previous is None or d not in previous.destinations(key)]
            build, build_var = 0.0, 0.0
            if new and self.prefix_of[key] > 0:
                arrives = -math.expm1(-self.rate_of[key] / kb * period_s)
                cost = self.prefix_of[key] * self.config.prefill_token_cost
                build = cost * arrives / period_s
                build_var = cost * cost * arrives * (1 - arrives) / period_s
            for d in assignments[key]:
                variance[d].append(piece_var)
                if d in new:
                    dest_load[d] += build
                    variance[d].append(build_var)
        return variance
