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
    make_decision,
    match_blocks,
    rank_keyed,
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
    """Longest match among the peers the load guard allows.

    Written as one pass per step with the per-peer helpers of ``types`` inlined (``match_blocks``, ``load``,
    ``backlog_tokens``): this is the default policy on every request's path.
    """
    alive = alive_peers(peers)
    n, bs, prompt, tiebreak = len(request.block_hashes), request.block_size, request.prompt_tokens, request.tiebreak
    rows: list[tuple[int, int, PeerSnapshot]] = []  # (clamped match, load, peer)
    for p in alive:
        m = p.est_match_blocks
        rows.append((m if 0 <= m <= n else (0 if m < 0 else n), p.running + p.waiting + p.in_flight, p))
    min_load = min([r[1] for r in rows])

    def backlog(p: PeerSnapshot, m: int) -> int:  # types.backlog_tokens(p, uncached_tokens(request, p))
        b = p.prefill_backlog_tokens
        return (p.waiting + p.in_flight) * (prompt - m * bs) if b is None else b

    # The reference alternative: the longest match among the least-loaded peers.
    least = [((-m, lo, not p.is_self), p.node_id, p) for m, lo, p in rows if lo == min_load]
    ref = rank_keyed(least, tiebreak)[0]
    ref_m = match_blocks(request, ref)
    ref_backlog = backlog(ref, ref_m)
    allowed: list[tuple[tuple[int, int, bool], str, PeerSnapshot]] = []
    barred: list[tuple[tuple[int, int, bool], str, PeerSnapshot]] = []
    for m, lo, p in rows:
        extra = lo - min_load
        if extra == 0 or (
            not (extra > balance_abs and lo > balance_rel * min_load)
            and backlog(p, m) - ref_backlog <= (m - ref_m) * bs
        ):
            allowed.append(((-m, lo, not p.is_self), p.node_id, p))
        else:
            barred.append(((lo, -m, not p.is_self), p.node_id, p))
    ranked = rank_keyed(allowed, tiebreak)
    if barred:
        ranked += rank_keyed(barred, tiebreak)

    target = ranked[0]
    m_target = match_blocks(request, target)
    m_best = max([r[0] for r in rows])
    if m_best == 0:
        reason = f"no match: least loaded (load {min_load})"
    elif m_target == m_best:
        reason = f"longest match {m_target} blocks"
    else:
        reason = f"load guard: {m_best}-block match not worth its load; {m_target} blocks at load {target.load}"
    return make_decision(NAME, request, ranked, reason)
