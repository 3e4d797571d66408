"""p2p (the default): the longest estimated prefix match, unless that peer's load makes the match not worth it.

Sources of the guard: SGLang router's two-threshold imbalance test (sgl-router cache_aware.rs: a gap above an
absolute AND a relative threshold) and Preble's E2 (exploit a cached prefix only when what it saves outweighs
the load it lands on). Unlike SGLang, the guard is applied per peer, not to the whole system: an overloaded node
elsewhere does not stop this request from going to a fine best-match peer.

Rule, over alive peers, with ``min_load`` the least load and ``a`` the reference alternative (the longest
match among the least-loaded peers):
- A peer is *within the guard* if it is least loaded, or both
  (1) not overloaded: not (``load > BALANCE_REL * min_load`` and ``load - min_load > BALANCE_ABS``), and
  (2) worth it: its extra prefill backlog over ``a`` (``types.backlog_tokens``) is at most the prefill its
      longer match saves over ``a`` (``(match - match_a) * block_size`` tokens).
- Target: the longest match within the guard; ties by lower load, then self (no hop), then ``tiebreak``.
  No match anywhere reduces to least loaded.
The ranked list is the peers within the guard in that order, then the others by load.
"""

from __future__ import annotations

from collections.abc import Sequence

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

NAME = "p2p"
#: Relative overload: a best-match peer carrying more than 1.5x the least load is a hotspot (SGLang's 1.5).
BALANCE_REL = 1.5
#: Absolute overload, in requests: a gap of up to 16 is batch noise on an engine running hundreds of sequences
#: (SGLang uses 64 for a router over many workers); it also caps how far a burst herds onto one holder.
BALANCE_ABS = 16


def route(
    request: RouteRequest,
    peers: Sequence[PeerSnapshot],
    plan: object | None = None,
    *,
    balance_rel: float = BALANCE_REL,
    balance_abs: int = BALANCE_ABS,
) -> Decision:
    """Longest match among the peers the load guard allows."""
    alive = alive_peers(peers)
    match = {p.node_id: match_blocks(request, p) for p in alive}
    load = {p.node_id: p.load for p in alive}
    min_load = min(load.values())

    def affinity(p: PeerSnapshot) -> tuple[int, int, bool]:
        return (-match[p.node_id], load[p.node_id], not p.is_self)

    ref = rank([p for p in alive if load[p.node_id] == min_load], affinity, request.tiebreak)[0]
    ref_match = match[ref.node_id]
    ref_backlog = backlog_tokens(ref, uncached_tokens(request, ref))

    def within_guard(p: PeerSnapshot) -> bool:
        extra = load[p.node_id] - min_load
        if extra == 0:
            return True
        if extra > balance_abs and load[p.node_id] > balance_rel * min_load:
            return False
        saved = (match[p.node_id] - ref_match) * request.block_size
        return backlog_tokens(p, uncached_tokens(request, p)) - ref_backlog <= saved

    allowed: list[PeerSnapshot] = []
    barred: list[PeerSnapshot] = []
    for p in alive:
        (allowed if within_guard(p) else barred).append(p)
    ranked = rank(allowed, affinity, request.tiebreak)
    if barred:
        ranked += rank(barred, lambda p: (load[p.node_id], -match[p.node_id], not p.is_self), request.tiebreak)

    m_target, m_best = match[ranked[0].node_id], max(match.values())
    if m_best == 0:
        reason = f"no match: least loaded (load {min_load})"
    elif m_target == m_best:
        reason = f"longest match {m_target} blocks"
    else:
        target_load = load[ranked[0].node_id]
        reason = f"load guard: {m_best}-block match not worth its load; {m_target} blocks at load {target_load}"
    return make_decision(NAME, request, ranked, reason)
