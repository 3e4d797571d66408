"""SGLang router's cache-aware policy: prefix affinity while balanced, shortest queue while imbalanced.

Source: sgl-project/sglang, sgl-router/src/policies/cache_aware.rs (``CacheAwarePolicy::select_worker``) and the
router's CLI defaults (cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5).

Rule, over alive peers with ``load`` standing for the router's per-worker pending-request count:
1. Imbalanced iff ``max_load - min_load > BALANCE_ABS_THRESHOLD`` and ``max_load > BALANCE_REL_THRESHOLD *
   min_load``. Then: shortest queue (least load).
2. Otherwise take the peer with the highest prefix match rate (matched tokens / prompt tokens; SGLang counts
   characters of an approximate text tree, p2pnode counts tokens of the estimated block match). If that rate
   ``> CACHE_THRESHOLD``, route there; else to the peer with the smallest tree (``tree_blocks``: most room
   for a new prefix).

Tree size: SGLang's router inserts a request's text into its worker's tree when it routes it, so a worker busy
with a long prompt already looks full. A gossiped cache size only counts blocks stored so far, which leaves out what
running prefills are computing: the busiest node would look emptiest and attract every cold request. So the tree is
the gossiped ``cached_blocks`` plus the blocks of the prompt tokens still to prefill there
(``prefill_backlog_tokens``, this ingress's own sends included).

Differences, on purpose: loads are taken over alive peers only (SGLang takes them over every registered
worker); ties (SGLang: first index, or tree internals) are broken by load, then ``tiebreak``; an unknown
``cached_blocks`` counts as 0, so with no tree sizes the miss path is least loaded. The ranked list follows the
branch's own order (load; match then load; tree size then load).
"""

from __future__ import annotations

from collections.abc import Sequence

from p2pnode.plan.plan import Plan
from p2pnode.routing.policies.spec import PolicySpec, Role
from p2pnode.routing.policies.types import (
    Decision,
    PeerSnapshot,
    RouteRequest,
    alive_peers,
    make_decision,
    match_blocks,
    rank,
)

NAME = "sglang"
#: Minimum prefix match rate for affinity routing (router default 0.3; the Python launcher once used 0.5).
CACHE_THRESHOLD = 0.3
#: Imbalance needs max - min load above this many requests (router default 64)...
BALANCE_ABS_THRESHOLD = 64
#: ...and max load above this multiple of min load (router default 1.5).
BALANCE_REL_THRESHOLD = 1.5


def is_imbalanced(max_load: int, min_load: int, abs_threshold: int, rel_threshold: float) -> bool:
    """SGLang's two-threshold test: both the gap and the ratio must be large."""
    return max_load - min_load > abs_threshold and max_load > min_load * rel_threshold


def route(
    request: RouteRequest,
    peers: Sequence[PeerSnapshot],
    plan: Plan | None = None,
    *,
    cache_threshold: float = CACHE_THRESHOLD,
    balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
    balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
) -> Decision:
    """Shortest queue when imbalanced; else highest match rate above the threshold; else smallest tree."""
    alive = alive_peers(peers)
    loads = [p.requests for p in alive]
    max_load, min_load = max(loads), min(loads)
    if is_imbalanced(max_load, min_load, balance_abs_threshold, balance_rel_threshold):
        ranked = rank(alive, lambda p: p.requests, request.tiebreak)
        return make_decision(NAME, request, ranked, f"imbalanced (max {max_load}, min {min_load}): shortest queue")

    by_match = rank(alive, lambda p: (-match_blocks(request, p), p.requests), request.tiebreak)
    best = by_match[0]
    rate = match_blocks(request, best) * request.block_size / request.prompt_tokens if request.prompt_tokens else 0.0
    if rate > cache_threshold:
        return make_decision(NAME, request, by_match, f"match rate {rate:.2f} > {cache_threshold}")
    bs = request.block_size
    ranked = rank(alive, lambda p: (tree_blocks(p, bs), p.requests), request.tiebreak)
    return make_decision(NAME, request, ranked, f"match rate {rate:.2f} <= {cache_threshold}: smallest tree")


def tree_blocks(peer: PeerSnapshot, block_size: int) -> int:
    """The peer's tree as SGLang's router would know it: cached blocks plus those its queued prefills will add."""
    return (peer.cached_blocks or 0) + -(-(peer.load.prefill_backlog_tokens or 0) // block_size)


SPEC = PolicySpec(
    NAME,
    route,
    role=Role.BASELINE,
    defaults={
        "cache_threshold": CACHE_THRESHOLD,
        "balance_abs_threshold": BALANCE_ABS_THRESHOLD,
        "balance_rel_threshold": BALANCE_REL_THRESHOLD,
    },
)
