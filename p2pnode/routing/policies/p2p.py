"""p2p (the default): the longest estimated prefix match, unless that peer's load makes the match not worth it.

Sources of the guard: SGLang router's two-threshold imbalance test (sgl-router cache_aware.rs: a gap above an
absolute AND a relative threshold) and Preble's E2 (exploit a cached prefix only when what it saves outweighs
the load it lands on). Unlike SGLang, the guard is applied per peer, not to the whole system: an overloaded node
elsewhere does not stop this request from going to a fine best-match peer.

Candidates (power of d choices): this node, every peer with an estimated match, and ``CHOICES`` peers drawn at
random for this request (``RouteRequest.sampled``, else drawn here with ``sample_peers``). Other peers are never
the target, only retries. Why: loads come from gossip, seconds old, and every ingress reads the same ones; if each
sent its cache-less requests to the mesh's least-loaded-looking peer, all would pile onto it until the next report
(herding). Choosing among a few random peers keeps old load information useful (Mitzenmacher, "How useful is old
information?", IEEE TPDS 2000), and this node's own load is live. Measured in the simulator (30 nodes, the
CacheRoute aggregate, 1 s gossip heard ~2.5 s later; ``docs/results.md``): at 150 QPS p99 TTFT 3.70 s with every
peer a candidate vs 0.23 s with one random peer, KV hit 0.40 vs 0.53 (the oracle with exact, instant state: 0.22 s,
0.56); 2 or 3 random peers did worse than 1 at 250 QPS (p99 0.68 and 1.41 s vs 0.32 s): the more choices, the more
the stale minimum attracts.

Rule, over the candidates, with ``min_load`` their least load and ``a`` the reference alternative (the longest
match among the least-loaded candidates):
- A candidate is *within the guard* if it is least loaded, or both
  (1) not overloaded: not (``load > BALANCE_REL * min_load`` and ``load - min_load > BALANCE_ABS``), and
  (2) worth it: its extra prefill backlog over ``a`` (``types.backlog_tokens``) is at most the prefill its
      longer match saves over ``a`` (``(match - match_a) * block_size`` tokens).
- Target: the longest match within the guard; ties by lower load, then self (no hop), then ``tiebreak``.
  No match anywhere reduces to the least loaded of this node and the sampled peers.
The ranked list is the candidates within the guard in that order, then the other candidates by load, then every
other alive peer by load.
"""

from __future__ import annotations

from collections.abc import Sequence

from p2pnode.plan.plan import Plan
from p2pnode.routing.policies.types import (
    Decision,
    PeerSnapshot,
    RouteRequest,
    alive_peers,
    make_decision,
    match_blocks,
    rank_keyed,
    sample_peers,
)

NAME = "p2p"
#: Relative overload: a best-match peer carrying more than 1.5x the least load is a hotspot (SGLang's 1.5).
BALANCE_REL = 1.5
#: Random peers among the candidates of every request (0: every alive peer, i.e. the global least loaded).
CHOICES = 1
#: Absolute overload, in requests: a gap of up to 16 is batch noise on an engine running hundreds of sequences
#: (SGLang uses 64 for a router over many workers); it also caps how far a burst herds onto one holder.
BALANCE_ABS = 16


def route(
    request: RouteRequest,
    peers: Sequence[PeerSnapshot],
    plan: Plan | None = None,
    *,
    balance_rel: float = BALANCE_REL,
    balance_abs: int = BALANCE_ABS,
    choices: int = CHOICES,
) -> Decision:
    """Longest match among the candidates the load guard allows.

    Written as one pass per step with the per-peer helpers of ``types`` inlined (``match_blocks``, ``load``,
    ``backlog_tokens``): this is the default policy on every request's path.
    """
    alive = alive_peers(peers)
    n, bs, prompt, tiebreak = len(request.block_hashes), request.block_size, request.prompt_tokens, request.tiebreak
    if choices <= 0:
        sampled: set[str] | None = None
    elif len(request.sampled) >= choices:
        sampled = set(request.sampled[:choices])
    else:
        sampled = set(sample_peers(sorted(p.node_id for p in alive if not p.is_self), tiebreak, choices))
    rows: list[tuple[int, int, PeerSnapshot]] = []  # candidates: (clamped match, load, peer)
    others: list[tuple[tuple[int, int, bool], str, PeerSnapshot]] = []
    for p in alive:
        m = p.est_match_blocks
        m = m if 0 <= m <= n else (0 if m < 0 else n)
        load = p.running + p.waiting + p.in_flight
        if sampled is None or m or p.is_self or p.node_id in sampled:
            rows.append((m, load, p))
        else:
            others.append(((load, 0, True), p.node_id, p))
    min_load = min([r[1] for r in rows])

    def backlog(p: PeerSnapshot, m: int) -> int:  # types.backlog_tokens(p, uncached_tokens(request, p))
        b = p.prefill_backlog_tokens
        return (p.waiting + p.in_flight) * (prompt - m * bs) if b is None else b

    # The reference alternative: the longest match among the least-loaded candidates.
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
    if others:
        ranked += rank_keyed(others, tiebreak)

    target = ranked[0]
    m_target = match_blocks(request, target)
    m_best = max([r[0] for r in rows])
    if m_best == 0:
        reason = f"no match: least loaded of {len(rows)} candidates (load {min_load})"
    elif m_target == m_best:
        reason = f"longest match {m_target} blocks"
    else:
        reason = f"load guard: {m_best}-block match not worth its load; {m_target} blocks at load {target.load}"
    return make_decision(NAME, request, ranked, reason)
