"""Preble's E2 (exploit / explore) global scheduling.

Sources: Srivatsa et al., "Preble: Efficient Distributed Prompt Scheduling for LLM Serving" (ICLR 2025), Sec. 4
(E2 algorithm); WukLab/preble, multi_node/global_scheduler_with_time.py (``runtime_selector``, ``get_node_cost``).

Rule:
- Exploit when the longest cached prefix is longer than the part that must be recomputed (code: ``missed <
  matched``, i.e. a matched fraction above ``EXPLOIT_THRESHOLD`` = 0.5): among the peers holding that longest
  match, the one with the lowest load cost.
- Otherwise explore: every alive peer, minimum of ``L + M + P``: L the peer's load cost (prefill plus decode
  time of its requests), M the cost of what this request would evict, P this request's prefill time there.

Mapping to p2pnode (Preble keeps a 3-minute window of routed requests per GPU; a pure function sees only the
snapshot): L = ``backlog_tokens`` x ``PREFILL_S_PER_TOKEN`` + ``load`` x ``max_tokens`` x ``TPOT_S`` (Preble's
decode cost is active requests x output length x TPOT, with this request's ``max_tokens`` as the length); P =
uncached tokens x ``PREFILL_S_PER_TOKEN``; M = 0 (Preble's eviction term is off by default in its code and the
snapshot does not say what an admission would evict). The ranked list is the exploit group by cost, then the
rest by cost (explore: all by cost).
"""

from __future__ import annotations

from collections.abc import Sequence

from p2pnode.plan.plan import Plan
from p2pnode.routing.policies.spec import CostModel, PolicySpec, Role
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

NAME = "preble"
#: Exploit iff matched tokens / prompt tokens > 0.5 (Preble: recompute less than what is cached).
EXPLOIT_THRESHOLD = 0.5
#: Prefill time per uncached token: ~10k tokens/s, an 8B model on one H100-class GPU. Only its ratio to TPOT_S
#: matters, and Preble fits it per model; the simulator may pass its own profile's values.
PREFILL_S_PER_TOKEN = 1e-4
#: Time per output token of one request: Preble's scheduler seeds its per-GPU TPOT estimate with 0.15 s.
TPOT_S = 0.15


def cost(
    request: RouteRequest,
    peer: PeerSnapshot,
    prefill_s_per_token: float = PREFILL_S_PER_TOKEN,
    tpot_s: float = TPOT_S,
) -> float:
    """Preble's L + M + P for ``peer`` (seconds of work), with M = 0."""
    uncached = uncached_tokens(request, peer)
    load_cost = backlog_tokens(peer, uncached) * prefill_s_per_token + peer.requests * request.max_tokens * tpot_s
    return load_cost + uncached * prefill_s_per_token


def route(
    request: RouteRequest,
    peers: Sequence[PeerSnapshot],
    plan: Plan | None = None,
    *,
    exploit_threshold: float = EXPLOIT_THRESHOLD,
    prefill_s_per_token: float = PREFILL_S_PER_TOKEN,
    tpot_s: float = TPOT_S,
) -> Decision:
    """Exploit the longest match when it covers most of the prompt; else the lowest-cost peer."""
    alive = alive_peers(peers)
    costs = {p.node_id: cost(request, p, prefill_s_per_token, tpot_s) for p in alive}
    best_match = max(match_blocks(request, p) for p in alive)
    matched = best_match * request.block_size
    if request.prompt_tokens and best_match and matched / request.prompt_tokens > exploit_threshold:
        holders = [p for p in alive if match_blocks(request, p) == best_match]
        others = [p for p in alive if match_blocks(request, p) != best_match]
        ranked = rank(holders, lambda p: costs[p.node_id], request.tiebreak)
        ranked += rank(others, lambda p: costs[p.node_id], request.tiebreak)
        frac = matched / request.prompt_tokens
        return make_decision(NAME, request, ranked, f"exploit: match {frac:.2f} of prompt > {exploit_threshold}")
    ranked = rank(alive, lambda p: costs[p.node_id], request.tiebreak)
    return make_decision(NAME, request, ranked, f"explore: lowest L+P {costs[ranked[0].node_id]:.3f}s")


#: The decode step TPOT is read at from a cost profile: a moderately loaded step (32 sequences of 2k tokens).
TPOT_BATCH, TPOT_CONTEXT = 32, 2048


def profile_params(profile: CostModel) -> dict[str, float]:
    """Preble fits its prefill rate and TPOT per model: the cost profile's (``PolicySpec.for_profile``)."""
    tpot = profile.step_time(0, 0.0, TPOT_BATCH, TPOT_BATCH * TPOT_CONTEXT)
    return {"prefill_s_per_token": profile.prefill_s_per_token, "tpot_s": tpot}


SPEC = PolicySpec(
    NAME,
    route,
    role=Role.BASELINE,
    defaults={"exploit_threshold": EXPLOIT_THRESHOLD, "prefill_s_per_token": PREFILL_S_PER_TOKEN, "tpot_s": TPOT_S},
    variants={"x": ("exploit_threshold", float)},
    profile_params=profile_params,
)
