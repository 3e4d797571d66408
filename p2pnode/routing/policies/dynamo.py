"""NVIDIA Dynamo's KV router: minimise a prefill + decode cost in blocks.

Source: ai-dynamo/dynamo, ``DefaultWorkerSelector::select_worker`` (lib/llm/src/kv_router/scheduler.rs, later
lib/kv-router/src/scheduling/selector.rs) and ``ActiveSequences::potential_blocks_and_tokens``; documented in
docs/router/README.md ("Cost Function"). Per worker, with overlap = cached blocks of this request there:

    prefill_tokens = (isl - overlap * block_size) + active_tokens      # new tokens + queued prefill there
    prefill_blocks = prefill_tokens / block_size                        # a float
    decode_blocks  = new_blocks + active_blocks                         # this request's blocks + held ones
    logit          = overlap_score_weight * prefill_blocks + decode_blocks

and, at temperature 0 (the default), the worker with the smallest logit; equal logits go to the smallest
tree, then (Dynamo: HashMap order) ``tiebreak``.

KV tiers (Dynamo's KVBM offloads to host memory and disk, and its indexer learns each block's tier from the engines'
events): the overlap credited against the prefill is the device overlap plus ``host_cache_hit_weight`` (0.75) per
block past it in the worker's host tier and ``disk_cache_hit_weight`` (0.25) per block past that on its disk
(lib/kv-router/src/scheduling/selector.rs, ``DefaultScorer``: ``default_host_cache_hit_weight`` 0.75,
``default_disk_cache_hit_weight`` 0.25); the decode blocks stay the device overlap's.

Mapping to p2pnode: overlap = ``est_match_blocks``; active_tokens = ``prefill_backlog_tokens``; active_blocks =
``active_blocks`` (fallbacks in ``types.backlog_tokens`` / ``types.active_blocks``); new_blocks = the request's
blocks minus the overlap (Dynamo counts blocks not already active on the worker, which the overlap
approximates); tree size = ``cached_blocks`` (unknown = 0). Temperature > 0 (softmax sampling) is not offered:
it is off by default and would need a sampler seeded from ``tiebreak``. The ranked list is ascending logit.
"""

from __future__ import annotations

from collections.abc import Sequence

from p2pnode.plan.plan import Plan
from p2pnode.routing.policies.spec import PolicySpec, Role
from p2pnode.routing.policies.types import (
    Decision,
    PeerSnapshot,
    RouteRequest,
    active_blocks,
    alive_peers,
    backlog_tokens,
    make_decision,
    match_blocks,
    rank,
    request_blocks,
    tier_blocks,
)

NAME = "dynamo"
#: kv_overlap_score_weight (Dynamo default 1.0): > 1 favours cache hits (TTFT), < 1 favours spreading decode (ITL).
OVERLAP_SCORE_WEIGHT = 1.0
#: router_temperature (Dynamo default 0.0): deterministic argmin. Only 0 is implemented.
ROUTER_TEMPERATURE = 0.0
#: Credit of a block a worker would load from its host tier, and from its disk tier, against one in its device KV
#: (Dynamo's defaults).
HOST_CACHE_HIT_WEIGHT = 0.75
DISK_CACHE_HIT_WEIGHT = 0.25


def logit(
    request: RouteRequest,
    peer: PeerSnapshot,
    overlap_score_weight: float = OVERLAP_SCORE_WEIGHT,
    host_cache_hit_weight: float = HOST_CACHE_HIT_WEIGHT,
    disk_cache_hit_weight: float = DISK_CACHE_HIT_WEIGHT,
) -> float:
    """Dynamo's cost of placing ``request`` on ``peer`` (lower is better)."""
    overlap = match_blocks(request, peer)
    credit: float = overlap
    if peer.est_host_blocks > overlap or peer.est_disk_blocks > overlap:
        _, host, disk = tier_blocks(request, peer)
        credit = overlap + host_cache_hit_weight * (host - overlap) + disk_cache_hit_weight * (disk - host)
    new_tokens = request.prompt_tokens - credit * request.block_size
    prefill_blocks = (new_tokens + backlog_tokens(peer, new_tokens)) / request.block_size
    n_blocks = request_blocks(request)
    return overlap_score_weight * prefill_blocks + (n_blocks - overlap) + active_blocks(peer, n_blocks)


def route(
    request: RouteRequest,
    peers: Sequence[PeerSnapshot],
    plan: Plan | None = None,
    *,
    overlap_score_weight: float = OVERLAP_SCORE_WEIGHT,
    host_cache_hit_weight: float = HOST_CACHE_HIT_WEIGHT,
    disk_cache_hit_weight: float = DISK_CACHE_HIT_WEIGHT,
) -> Decision:
    """Argmin of the logit; ties by smallest tree, then tiebreak."""
    alive = alive_peers(peers)
    logits = {
        p.node_id: logit(request, p, overlap_score_weight, host_cache_hit_weight, disk_cache_hit_weight) for p in alive
    }
    ranked = rank(alive, lambda p: (logits[p.node_id], p.cached_blocks or 0), request.tiebreak)
    best = ranked[0]
    return make_decision(
        NAME, request, ranked, f"min logit {logits[best.node_id]:.2f} (overlap {match_blocks(request, best)})"
    )


SPEC = PolicySpec(
    NAME,
    route,
    role=Role.BASELINE,
    defaults={
        "overlap_score_weight": OVERLAP_SCORE_WEIGHT,
        "host_cache_hit_weight": HOST_CACHE_HIT_WEIGHT,
        "disk_cache_hit_weight": DISK_CACHE_HIT_WEIGHT,
    },
)
