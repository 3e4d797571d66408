"""Routing by segments: how many of a request's segment tokens each node would reuse, the estimate ``p2p`` prices
like a prefix match (``PeerSnapshot.est_segment_tokens``).

What a node reuses of a request with segments is not its prefix as sent:
- ``approximate``: the segments its segment store holds, wherever they sit; the rest of the prompt runs under the
  approximate cache salt, whose blocks no index reports. Estimate: the tokens of the request's segments the node
  holds (past each one's ``recompute`` tokens, which are always computed), from the keys it gossips
  (``cache/segment_summary.py``) -- this node's own from its engine, live.
- ``exact``: the serving node lays the prompt out with the deepest chain of segments its cache holds first
  (``cache/segments.exact_layout``), so it reuses that chain as a plain prefix. Estimate: the same search -- the
  deepest chain of the request's segments that a node's prefix summary says it holds -- done once for every node at
  once: each order tried hashes one more segment's blocks and asks the directory for every peer's estimate of that
  chain (``estimate_matches``), and the search goes deeper wherever some node holds the whole chain so far. A peer's
  summary is stride-sampled (its estimate is under the truth by less than the stride), so "whole" allows
  ``slack`` blocks for peers; this node's own index is exact. At most ``MAX_ROUTE_LAYOUT_PROBES`` orders per request.

Both are estimates in tokens, never over what the summary shows (stale gossip aside), and cost nothing for requests
without segments: the router asks only for requests that name some and only for the policies that read them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.segments import SegmentSpans
from p2pnode.config import MAX_ROUTE_LAYOUT_PROBES

__all__ = ["approximate_estimates", "exact_estimates"]


def approximate_estimates(segments: SegmentSpans, holders: Mapping[str, Sequence[int]]) -> dict[str, int]:
    """``{node: tokens of the request's segments it would load}`` for the nodes that would load some; ``holders``
    names, per node, the indices of the segments it holds."""
    recompute = segments.recompute
    sizes = [max(0, end - start - recompute) for start, end in segments.spans]
    out: dict[str, int] = {}
    for node_id, held in holders.items():
        tokens = sum(sizes[i] for i in held)
        if tokens > 0:
            out[node_id] = tokens
    return out


def exact_estimates(
    tokens: Sequence[int],
    segments: SegmentSpans,
    block_size: int,
    estimate: Callable[[list[int]], Mapping[str, int]],
    *,
    head: int = 0,
    slack: Callable[[str], int] = lambda node_id: 0,
    max_probes: int = MAX_ROUTE_LAYOUT_PROBES,
) -> dict[str, int]:
    """``{node: tokens an exact-mode layout would reuse there}`` for the nodes that hold some chain of the request's
    segments (module docstring). ``estimate(chain)``: every node's estimated cached prefix of a block chain, in
    blocks (nodes it leaves out hold none of it); ``head``: the prompt's tokens that stay first (its BOS);
    ``slack(node)``: blocks that node's estimate may fall short of a chain it holds whole."""
    bs = block_size
    pieces = [list(tokens[start:end]) for start, end in segments.spans]
    best: dict[str, int] = {}
    probes = 0

    def search(used: tuple[int, ...], prefix: list[int], chain: list[int]) -> None:
        nonlocal probes
        full = len(chain)  # the prefix's full blocks, hashed once
        parent = chain[-1] if chain else None
        tail = prefix[full * bs :]
        for i, piece in enumerate(pieces):
            if i in used or probes >= max_probes:
                continue
            probes += 1
            candidate = prefix + piece
            extended = chain + block_hashes(tail + piece, bs, parent)
            whole = (len(candidate) - 1) // bs  # the blocks a cache can serve of it (never its last token)
            deeper = False
            for node_id, blocks in estimate(extended).items():
                held = blocks * bs
                if held > best.get(node_id, 0):
                    best[node_id] = held
                if blocks > 0 and blocks + slack(node_id) >= whole:
                    deeper = True
            if deeper:
                search((*used, i), candidate, extended)

    start = list(tokens[:head])
    search((), start, block_hashes(start, bs) if start else [])
    return best
