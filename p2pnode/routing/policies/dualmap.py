"""DualMap-style two-choice routing: two hash-chosen candidates per prefix key, cache affinity first, load when
affinity would break the TTFT SLO.

Source: Yuan et al., "DualMap: Enabling Both Cache Affinity and Load Balancing for Distributed LLM Serving"
(ICLR 2026, arXiv 2602.06502): each request's prompt prefix is mapped by two independent hash functions (a
dual hash ring) to two candidate instances; "SLO-aware request routing prioritizes cache affinity but switches
to load-aware scheduling when TTFT exceeds the SLO". Only the abstract and summaries were available to us, so
the exact TTFT model and SLO value below are our reading, not the paper's numbers.

Rule:
1. Candidates: the first alive node clockwise from ``routing_key`` on ring A (seed ``SEED_A``), and the first
   alive node other than that one on ring B (seed ``SEED_B``); one candidate if only one peer is alive.
2. The affinity candidate has the longer estimated match (equal: the one with the lower estimated TTFT, then
   ring A's). Estimated TTFT there = (prefill backlog + this request's uncached tokens) x
   ``PREFILL_S_PER_TOKEN``.
3. If its estimated TTFT <= ``TTFT_SLO_S``, route there; else to the candidate with the lower estimated TTFT.
The ranked list is the chosen candidate, the other one, then every other alive peer by estimated TTFT.
DualMap's hotspot-aware rebalancing (migrating queued requests) and adaptive prefix length are stateful and
out of scope for a pure policy; ``routing_key`` stands in for the hashed prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

from p2pnode.plan.plan import Plan
from p2pnode.routing.policies.hashring import DEFAULT_VNODES, key_point, ring_for
from p2pnode.routing.policies.spec import CostModel, PolicySpec, Reads, Role
from p2pnode.routing.policies.types import (
    Decision,
    PeerSnapshot,
    RouteRequest,
    alive_peers,
    backlog_tokens,
    make_decision,
    match_blocks,
    rank,
    uncached_tokens,
)

NAME = "dualmap"
#: Seeds of the two independent rings (any two distinct fixed values). Ring A is sticky's/chwbl's ring.
SEED_A = 0
SEED_B = 0x9E3779B97F4A7C15
#: Virtual nodes per node on each ring (ketama's 160).
VNODES = DEFAULT_VNODES
#: Estimated TTFT above which affinity yields to load: the simulator's default p99 TTFT SLO (3.5 s, CacheRoute's).
TTFT_SLO_S = 3.5
#: Prefill time per uncached token for the TTFT estimate (~10k tokens/s, an 8B model on one H100-class GPU).
PREFILL_S_PER_TOKEN = 1e-4


def estimated_ttft(
    request: RouteRequest, peer: PeerSnapshot, prefill_s_per_token: float = PREFILL_S_PER_TOKEN
) -> float:
    """Queued prefill plus this request's own uncached prefill, in seconds."""
    uncached = uncached_tokens(request, peer)
    return (backlog_tokens(peer, uncached) + uncached) * prefill_s_per_token


def candidates(request: RouteRequest, peers: Sequence[PeerSnapshot]) -> list[str]:
    """The one or two distinct alive candidates of the key, ring A's first."""
    alive = {p.node_id for p in peers if p.alive}
    ids = [p.node_id for p in peers]
    first = ring_for(ids, VNODES, SEED_A).lookup(key_point(request.routing_key, SEED_A), alive.__contains__)
    if first is None:
        return []
    second = ring_for(ids, VNODES, SEED_B).lookup(
        key_point(request.routing_key, SEED_B), lambda n: n in alive and n != first
    )
    return [first] if second is None else [first, second]


def route(
    request: RouteRequest,
    peers: Sequence[PeerSnapshot],
    plan: Plan | None = None,
    *,
    ttft_slo_s: float = TTFT_SLO_S,
    prefill_s_per_token: float = PREFILL_S_PER_TOKEN,
) -> Decision:
    """Affinity between the two candidates unless it breaks the SLO, then the faster of the two."""
    alive = {p.node_id: p for p in alive_peers(peers)}
    pair = [alive[n] for n in candidates(request, peers)]
    ttft = {p.node_id: estimated_ttft(request, p, prefill_s_per_token) for p in alive.values()}
    # sorted() is stable, so ring A's candidate wins a full tie.
    by_affinity = sorted(pair, key=lambda p: (-match_blocks(request, p), ttft[p.node_id]))
    chosen = by_affinity[0]
    reason = f"affinity candidate (match {match_blocks(request, chosen)}, ttft {ttft[chosen.node_id]:.2f}s)"
    if ttft[chosen.node_id] > ttft_slo_s:
        chosen = min(pair, key=lambda p: ttft[p.node_id])
        reason = f"SLO {ttft_slo_s}s exceeded at affinity candidate: faster candidate ({ttft[chosen.node_id]:.2f}s)"
    head = [chosen] + [p for p in pair if p is not chosen]
    head_ids = {p.node_id for p in head}
    rest = rank([p for p in alive.values() if p.node_id not in head_ids], lambda p: ttft[p.node_id], request.tiebreak)
    return make_decision(NAME, request, head + rest, reason)


def profile_params(profile: CostModel) -> dict[str, float]:
    """DualMap's TTFT estimate uses the engine's prefill rate: the cost profile's (``PolicySpec.for_profile``)."""
    return {"prefill_s_per_token": profile.prefill_s_per_token}


SPEC = PolicySpec(
    NAME,
    route,
    role=Role.BASELINE,
    defaults={"ttft_slo_s": TTFT_SLO_S, "prefill_s_per_token": PREFILL_S_PER_TOKEN},
    reads_of=lambda params: Reads(keyed=True),
    variants={"t": ("ttft_slo_s", float)},
    profile_params=profile_params,
    #: A run gives it a threshold other than its 3.5 s as ``dualmap@t<seconds>`` or, for every policy that steers by
    #: one, ``PolicySpec.with_ttft_slo`` (``p2pnode sim --dualmap-ttft-slo``).
    ttft_slo_param="ttft_slo_s",
)
