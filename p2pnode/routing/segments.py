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

**Pulling segments** (``segment_pulls``; approximate mode only, and only where KV moves: a link figure and one KV
layout): the serving node, once a request has reached it, may load a segment its own store lacks from a peer whose
gossiped keys hold it instead of computing it. Each such segment is priced by the routing policy's price of a pull
(``SegmentPullPrice``, which the policy's spec makes: ``PolicySpec.segment_pull_price``; ``p2p``'s is a prefix pull's,
the segment's KV over the holder's link figure, a round trip and one engine step of the holder, in prefill-token
units, at weight 1) against computing it here (its tokens at the price's ``uncached_weight``), and pulled from the
holder where that is cheapest, when it is cheaper than computing. A request's segments
from one holder share its link one after another, so each is priced behind those already taken from that holder
(``bytes so far + its own``); pulls from different holders run side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.segments import SegmentReuse, SegmentSpans
from p2pnode.config import MAX_ROUTE_LAYOUT_PROBES

if TYPE_CHECKING:  # a policy module makes the price, so this module imports none at run time
    from p2pnode.routing.policies.types import PeerSnapshot

__all__ = [
    "SegmentPull", "SegmentPullPrice", "approximate_estimates", "by_holder", "exact_estimates", "segment_pulls",
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class SegmentPull:
    """Load the request's segment ``index`` (``tokens`` tokens of KV, the whole segment) from ``holder``'s store."""

    index: int
    holder: str
    tokens: int


class SegmentPullPrice(Protocol):
    """What a segment pull is priced with (module docstring), as the routing policy prices a pull."""

    #: The weight of the prefill a pulled token saves, against the transfer's prefill-token units.
    @property
    def uncached_weight(self) -> float: ...

    #: Pull every segment a peer holds, whatever it costs (``--kv-pull-force``: tests and evidence, where moving a
    #: tiny model's KV never pays); the cheapest holder is still chosen.
    @property
    def force(self) -> bool: ...

    def transfer_tokens(self, tokens: int, holder: PeerSnapshot) -> float:
        """What moving ``tokens`` tokens of KV from ``holder`` adds to the first token, in prefill-token units."""
        ...


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


def segment_pulls(
    segments: SegmentSpans,
    held: Callable[[int], bool],
    holders: Mapping[str, Sequence[int]],
    peers: Mapping[str, PeerSnapshot],
    price: SegmentPullPrice,
) -> tuple[SegmentPull, ...]:
    """The segments the serving node should pull, and from whom (module docstring, "Pulling segments"), in the
    request's order. ``held(key)``: whether this node's store holds it; ``holders``: per peer, the indices of the
    request's segments it gossips holding; ``peers``: the peers a pull may come from (alive, of this node's KV
    layout; ``link_bytes_per_s`` > 0), others in ``holders`` are skipped. Exact mode pulls nothing (its reuse is a
    prefix: ``p2p``'s own pulls)."""
    if segments.mode is not SegmentReuse.APPROXIMATE or not holders:
        return ()
    by_segment: dict[int, list[PeerSnapshot]] = {}
    for node_id, held_there in holders.items():
        p = peers.get(node_id)
        if p is None or p.is_self or not p.alive or p.link_bytes_per_s <= 0:
            continue
        for i in held_there:
            by_segment.setdefault(i, []).append(p)
    taken: dict[str, int] = {}  # holder -> tokens already pulled from it for this request
    out: list[SegmentPull] = []
    recompute = segments.recompute
    for i, ((start, end), key) in enumerate(zip(segments.spans, segments.keys, strict=True)):
        sources = by_segment.get(i)
        size = end - start
        saved = size - recompute  # its first ``recompute`` tokens are computed anyway
        if not sources or saved <= 0 or held(key):
            continue
        best: tuple[float, str] | None = None
        for p in sources:
            c = price.transfer_tokens(taken.get(p.node_id, 0) + size, p)
            if best is None or (c, p.node_id) < best:
                best = (c, p.node_id)
        assert best is not None
        if price.force or best[0] < price.uncached_weight * saved:
            out.append(SegmentPull(i, best[1], size))
            taken[best[1]] = taken.get(best[1], 0) + size
    return tuple(out)


def by_holder(pulls: Iterable[SegmentPull]) -> dict[str, tuple[int, ...]]:
    """``pulls`` as one ask per holder: the indices of the request's segments to pull from it, in request order (a
    holder lends the segments one request asks of it in one export)."""
    out: dict[str, list[int]] = {}
    for p in pulls:
        out.setdefault(p.holder, []).append(p.index)
    return {holder: tuple(indices) for holder, indices in out.items()}
