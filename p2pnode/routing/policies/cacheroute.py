"""cacheroute: route by the shared rate plan (CacheRoute-style): warm keys to their planned destinations.

Source: CacheRoute's plan (warm set of hot keys, LPT placement by expected load, k_b destinations for keys above
one destination's share); the plan is built by ``p2pnode.plan.planner`` and spread by gossip. The policy itself
stays a pure function: the plan is its third argument, so the node and the simulator run exactly this code.

Rule:
- **Warm key** (``request.routing_key`` is in the plan): the plan placed k_b equal pieces of the key's load, one per
  destination, so each alive destination's share of the key's requests starts at 1 / (alive destinations). The shares
  then lean on what the destinations served lately (``fill_shares``) for a request whose whole prompt every
  destination is estimated to hold, so that moving it costs no cache, and a whale -- pieces on many destinations, by
  the planner's half-share q_cap -- becomes the filler that absorbs the Poisson excess of the small keys pinned beside
  it. A destination whose recent served work (``PeerSnapshot.served_rate``, from its gossiped served counts,
  ``routing/served_rate.py``) is ``x`` per second above the mean of the key's destinations gets ``FILL_GAIN * x`` of
  the key's load per second less, one below gets more, each within ``FILL_PIECES`` (half to one and a half) of its
  piece and within ``FILL_MAX_SHIFT`` (0.05) of it, summing to 1; no figure: the plan's equal shares. Every ingress
  reads the same gossiped figures, but none sends a burst after them: each splits its own requests by these shares
  with its counts (below), so the mesh's split moves as the shares do instead of herding onto the emptiest
  destination. The request goes to a destination still below its share at this ingress (``RouteRequest.plan_sends``:
  the ingress's sends of the key to each destination under this plan, ``routing/split.py``): deficit = share *
  (sends+1) - its sends > 0; among those, the best estimated match, then the largest deficit, then the lowest load,
  then ``tiebreak``. The prefix match only chooses among destinations within their share, so a whale's traffic splits
  as planned instead of staying with whichever destination cached it first (a match-first rule sent 434 of 434
  requests of a k_b = 2 key to one node on a live mesh). Safety net: a destination above CHWBL's bound over the key's
  destinations (``load + 1 <= ceil(1.25 * (their total load + 1) / their number)``, ``chwbl.load_cap``) is passed over
  while another is within it. Then the other destinations, least loaded first. Without ``plan_sends`` (a caller that
  does not count) every destination counts as within its share. Leaning the split was measured on the live plan-mesh
  scene in the simulator (``scripts/sim_plan_mesh.py``, 16 nodes, seeds 0-2, docs/results-history.md, "The plan's
  expected loads against what was served"): served work max/mean 1.04-1.09 (1.04-1.06 before the 0.05 cap) against
  1.10-1.16 with equal shares and a whole-share q_cap -- below the 1.11 a perfect static plan scatters to
  (``scripts/plan_noise_floor.py``); leaning alone, with the whale on half the destinations, changed nothing (the
  busiest destination carried only small keys).
- **Warm key, a request that names segments** (``RouteRequest.segment_mode``): what a destination reuses of it is
  its documents, not the key's prefix (which every destination of the key holds), so the key's destinations within
  CHWBL's bound are priced as ``p2p`` prices any request with segments -- each one's estimate of the segments it
  holds (``PeerSnapshot.est_segment_tokens``), its queue and load -- and the cheapest serves; the shares' split is
  not applied (it would send a request's documents to whichever destination is due). Without this, turning the plan
  on scattered a RAG service's documents: its shared system prompt is one warm key on most of the mesh.
- **Cold key**, no plan, a plan whose shadow-replay gate turned affinity off (``Plan.affinity``), or no
  destination of the key alive (a plan outlives its destinations until the next replan): the *fallback*
  policy -- ``flat`` (cache-blind least loaded), ``p2p`` (the default: the cost of prefill and queue) or ``chwbl``
  (bounded-load consistent hashing of the routing key), chosen with the ``fallback`` keyword.
- The ranked list is the alive destinations in that order, then every other alive peer in the fallback's order.

Default: ``fallback="p2p"`` (``DEFAULT_FALLBACK``), decided by the simulator (``scripts/sim_findings.py``,
docs/results-history.md "The papers' findings"; 30 nodes, 8B/H100 profile, SLO p99 TTFT 3.5 s, 5 seeds, SLO
capacity in QPS with its 95% interval, ladder step 50, 25 on low-reuse):

| workload | flat fallback | chwbl fallback | p2p fallback |
|---|---:|---:|---:|
| cacheroute-aggregate | 100 | 310 ± 28 (330 ± 14 at a 25-QPS step) | 350 (355 ± 14) |
| whales | 200 | 330 ± 34 | 350 ± 44 |
| low-reuse | 70 ± 14 | 115 ± 17 | 120 ± 14 |

On these workloads the plan's warm set carries a small share of the load (the aggregate's keys are too cold for
``min_rate``), so the fallback routes most requests, and a cache-blind fallback throws away the reuse the plan
does not pin (KV hit 0.06 against 0.37 on the aggregate at capacity) while herding on stale loads. ``p2p`` is at
least as good as ``chwbl`` everywhere and better on the aggregate, where multi-turn threads reward the longest
match over the key's hash. The result assumes ``p2p``'s sampled candidates (commit b306685); re-run the script
when ``p2p`` changes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from p2pnode.plan.plan import Plan
from p2pnode.routing.policies import chwbl, flat, p2p
from p2pnode.routing.policies.spec import CostModel, PolicySpec, Reads, Role
from p2pnode.routing.policies.types import (
    Decision,
    PeerSnapshot,
    Policy,
    RouteRequest,
    match_blocks,
    rank,
)

NAME = "cacheroute"
#: The policies cold keys may follow, by name.
FALLBACKS: dict[str, Policy] = {flat.NAME: flat.route, p2p.NAME: p2p.route, chwbl.NAME: chwbl.route}
#: Fallback for keys outside the plan (see the module docstring for the simulator's comparison).
DEFAULT_FALLBACK = p2p.NAME
#: How hard a whale's split leans on its destinations' recent served work (``fill_shares``): a destination that served
#: x work/s above its peers' mean gets ``FILL_GAIN * x`` of the key's load per second less.
FILL_GAIN = 1.0
#: The least and most of its piece a destination of a key is leaned to, before normalising: a destination that
#: served far more keeps some of the key (its prefix stays warm), and one that reports little served work (new, or
#: restarted) cannot take the whole key.
FILL_PIECES = (0.5, 1.5)
#: The most a destination's share of a key moves from its piece, whatever the figures: a warm key's split stays
#: within 0.1 of the plan's shares (the rate plan's promise to an operator reading ``status``), with the other half
#: of that left for the noise of which requests arrive where. A whale in steady state leans by 0.02-0.03; the cap
#: binds after a destination restarts (its cold cache makes its work per request high for a while).
FILL_MAX_SHIFT = 0.05


def route(
    request: RouteRequest,
    peers: Sequence[PeerSnapshot],
    plan: Plan | None = None,
    *,
    fallback: str = DEFAULT_FALLBACK,
) -> Decision:
    """Warm key: its best alive planned destination; otherwise the fallback policy."""
    try:
        fallback_policy = FALLBACKS[fallback]
    except KeyError:
        raise ValueError(f"unknown cacheroute fallback {fallback!r}; valid: {', '.join(FALLBACKS)}") from None
    base = fallback_policy(request, peers, None)  # also validates peers (alive, unique ids)
    if plan is not None and not plan.affinity:
        reason = f"gate: affinity off, {fallback}: {base.reason}"
        return Decision(base.ranked, NAME, base.est_match_blocks, reason, base.pull)
    planned = plan.destinations(request.routing_key) if plan is not None else ()
    if not planned:
        return Decision(base.ranked, NAME, base.est_match_blocks, f"cold key, {fallback}: {base.reason}", base.pull)
    alive = {p.node_id: p for p in peers if p.alive}
    warm = [alive[d] for d in planned if d in alive]
    if not warm:
        reason = f"warm key, none of {len(planned)} destinations alive, {fallback}: {base.reason}"
        return Decision(base.ranked, NAME, base.est_match_blocks, reason, base.pull)
    cap = chwbl.load_cap(sum(p.requests for p in warm), len(warm))
    bounded = [p for p in warm if p.requests + 1 <= cap]  # never empty: the least loaded is at most the mean
    if request.segment_mode is not None:  # its documents' holders priced among the key's destinations
        inner = p2p.route(request, bounded, None)
        reason = f"warm key with segments: {len(warm)}/{len(planned)} destinations alive, p2p among {len(bounded)}"
        return _warm_decision(request, [alive[n] for n in inner.ranked], warm, base, f"{reason}: {inner.reason}")
    sends = request.plan_sends or {}
    total = sum(sends.get(p.node_id, 0) for p in warm)
    shares = fill_shares(plan, request, warm)  # type: ignore[arg-type]
    deficit = {p.node_id: shares[p.node_id] * (total + 1) - sends.get(p.node_id, 0) for p in warm}
    within = [p for p in bounded if deficit[p.node_id] > 0] or bounded
    ranked = rank(within, lambda p: (-match_blocks(request, p), -deficit[p.node_id], p.requests), request.tiebreak)
    target = ranked[0]
    reason = (
        f"warm key: {len(warm)}/{len(planned)} destinations alive, {sends.get(target.node_id, 0)} of "
        f"{total} sent to this one (share {shares[target.node_id]:.2f}), load {target.requests}"
    )
    return _warm_decision(request, ranked, warm, base, reason)


def _warm_decision(
    request: RouteRequest, ranked: list[PeerSnapshot], warm: Sequence[PeerSnapshot], base: Decision, reason: str
) -> Decision:
    """``ranked`` (the key's destinations chosen first), then its other destinations least loaded first, then every
    other peer in the fallback's order."""
    chosen = {p.node_id for p in ranked}
    ranked += rank(
        [p for p in warm if p.node_id not in chosen],
        lambda p: (p.requests, -match_blocks(request, p)),
        request.tiebreak,
    )
    chosen = {p.node_id for p in ranked}
    return Decision(
        ranked=tuple(p.node_id for p in ranked) + tuple(n for n in base.ranked if n not in chosen),
        policy=NAME,
        est_match_blocks=match_blocks(request, ranked[0]),
        reason=reason,
    )


def fill_shares(plan: Plan, request: RouteRequest, warm: Sequence[PeerSnapshot]) -> dict[str, float]:
    """Each alive destination's share of the request's key: the plan's equal pieces, leaned on recent served work.

    A destination that served ``x`` work/s more than the mean of the key's rated destinations (``served_rate``, in the
    plan's unit) gets ``FILL_GAIN * x`` of the key's load per second less, one that served less gets more; each keeps
    between ``FILL_PIECES`` of its piece and within ``FILL_MAX_SHIFT`` of it, and the shares sum to 1. A destination
    without a rate counts as at the mean; with fewer than two rated, or a key without an expected load, the shares
    are the plan's. And only where leaning costs no cache: when every destination is estimated to hold all of this
    prompt's full blocks (a whale's shared prefix with a short suffix). Where they hold only part of it (a platform
    prompt shared by long conversations, whose latest turn one destination holds, often before gossip says so)
    leaning cost KV hits on ``bench_routing``'s platform-chat-long (0.343 -> 0.319 at 9 QPS, 6 seeds, even when
    leaning only requests the destinations were estimated to hold equally), so those keep the plan's equal shares.
    """
    base = 1.0 / len(warm)
    key_load = plan.key_load.get(request.routing_key, 0.0)
    rates = {
        p.node_id: p.served_rate.work(plan.prefill_token_cost, plan.decode_token_cost)
        for p in warm
        if p.served_rate is not None
    }
    if len(rates) < 2 or not key_load > 0 or any(match_blocks(request, p) < len(request.block_hashes) for p in warm):
        return {p.node_id: base for p in warm}
    mean = math.fsum(rates.values()) / len(rates)
    lo = max(FILL_PIECES[0] * base, base - FILL_MAX_SHIFT)
    hi = min(FILL_PIECES[1] * base, base + FILL_MAX_SHIFT)
    raw = {p.node_id: base + FILL_GAIN * (mean - rates.get(p.node_id, mean)) / key_load for p in warm}
    if not all(map(math.isfinite, raw.values())):  # a key's load so small the lean overflows: no lean
        return {p.node_id: base for p in warm}
    return _within(raw, lo, hi)


#: Most halvings ``_within`` takes: from any finite interval to the nearest floats (a served-rate spread ~10^4 times
#: a key's load put the offsets where 1e-12 is below a float's spacing, and the loop never ended).
_BISECTIONS = 2_100


def _within(raw: dict[str, float], lo: float, hi: float) -> dict[str, float]:
    """The shares closest to ``raw`` (which sums to 1: the deviations from the mean cancel) with each in [lo, hi]:
    ``raw`` itself when it is within them (a whale's usual lean), else ``raw`` less one common offset, clipped
    (needs ``lo * len(raw) <= 1 <= hi * len(raw)``). Clipping then dividing by the sum would push the unclipped
    shares past the bounds."""
    if all(lo <= r <= hi for r in raw.values()):
        return raw

    def total(offset: float) -> float:
        return math.fsum(min(max(r - offset, lo), hi) for r in raw.values())

    low, high = min(raw.values()) - hi, max(raw.values()) - lo  # total(low) = n * hi >= 1 >= n * lo = total(high)
    for _ in range(_BISECTIONS):  # bounded: past ~8,192 two neighbouring floats are further apart than 1e-12
        mid = (low + high) / 2
        if high - low <= 1e-12 or mid in (low, high):  # close enough, or as close as floats get
            break
        low, high = (mid, high) if total(mid) > 1.0 else (low, mid)
    return {node_id: min(max(r - low, lo), hi) for node_id, r in raw.items()}


def reads(params: Mapping[str, Any]) -> Reads:
    """Keyed and plan-driven, leaning a whale's split on its destinations' served rates; sparse when its fallback is
    (``flat``, ``p2p``). With ``p2p`` (the default) it reads what ``p2p`` at its defaults reads -- its sample, its
    home, the holders the router draws -- and, like it, only its candidates' sends: its target is a warm key's
    destination (handed as planned) or ``p2p``'s, so another peer would only order the retries past them, and a
    decision at a busy ingress, or over a prefix many peers hold, costs O(candidates)."""
    fallback = params["fallback"]
    if fallback == p2p.NAME:
        inner = p2p.reads(p2p.SPEC.defaults)
        return dataclasses.replace(inner, keyed=True, plan=True, served_rates=True)
    return Reads(sparse=fallback == flat.NAME, keyed=True, plan=True, served_rates=True)


def segment_pull_price(params: Mapping[str, Any], profile: CostModel, force: bool) -> p2p.PullPrice:
    """Priced as ``p2p`` prices them at its defaults: only a ``p2p`` fallback routes by segments (``reads``)."""
    return p2p.segment_pull_price(p2p.SPEC.defaults, profile, force)


SPEC = PolicySpec(
    NAME,
    route,
    role=Role.OURS,
    defaults={"fallback": DEFAULT_FALLBACK},
    reads_of=reads,
    #: ``cacheroute-flat``, ``cacheroute-p2p`` (= ``cacheroute``), ``cacheroute-chwbl``: an explicit fallback.
    named={f"{NAME}-{fallback}": {"fallback": fallback} for fallback in FALLBACKS},
    #: Planner what-ifs: ``@k<top_k>`` (warm-set size) and ``@r<min_rate>`` (admission rate), e.g. ``cacheroute@k512``.
    planner_variants={"k": ("top_k", int), "r": ("min_rate", float)},
    segment_pull_price=segment_pull_price,
)
