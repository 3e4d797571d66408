"""What one cache of a given size can reuse of a segmented workload: the bounds a run's hit is read against.

A run's KV hit depends on its cache, its store and its routing; these bounds depend only on the requests and a size,
so every result can be reported beside what any cache of that size would reach with the same eviction order. One
LRU over tokens, at the granularity of the prompts' pieces (a piece is held or evicted whole; a piece larger than the
cache is never held), fed every request's prompt in arrival order (outputs are the requests' own and never reused, so
they are not fed):

- **prefix caching**: a piece hits only if every piece before it in the prompt hit; it is keyed by the whole chain of
  pieces up to it (what a block hash is at a block's granularity);
- **segment reuse**: a named segment hits wherever it stands (keyed by itself, position-free: approximate mode's
  store); any other piece is keyed by its chain, as above, and hits only if every piece before it hit -- so the
  leading text (a system prompt) is a prefix chain, and text after the segments hits only when its whole prompt so far
  repeats.

After a request, its pieces are used again from the last to the first, so a prompt's head is the most recently used
(vLLM frees a request's blocks tail first, for the same reason). The hit is the measured requests' hit tokens over
their prompt tokens, the first ``warmup`` share of requests filling the cache unmeasured (``p2pnode sim --warmup``'s
share, by count).

A bound of that eviction order, not an optimum: a cache that knew the future (Belady) would do better, and a cache
split between a paged prefix cache and a segment store (the simulator's approximate mode) holds the same tokens in two
LRUs. The mesh-wide bound is one such cache holding every node's KV (``nodes`` x the size): what a mesh whose
routing and pulls were perfect could reuse.

A mesh that moves no KV cannot reach that bound: a request reuses only what its one node holds, and the documents a
request names are drawn independently, so the pooled cache's hit is out of any one node's reach. ``routed`` is the
reference for such a mesh: ``nodes`` caches of the per-node size (the same LRU each), every request sent to the node
holding most of its tokens by the same rule -- perfect, current knowledge of every cache -- among the nodes that served
less than ``(1 + slack) / nodes`` of the last ``window`` requests (a load bound, as a router keeps one; ties to the
least loaded, then the first). A greedy reference, not an optimum: it is what the best-informed router of this kind
reaches, so a mesh below it loses to its estimates, and a mesh near it has no more to win by routing alone.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from p2pnode.sim.workloads.segmented_trace import SegmentedPiece, SegmentedRecord

__all__ = ["Bounds", "PieceLRU", "bounds", "routed"]


class PieceLRU:
    """An LRU over tokens whose entries are pieces (or chains of them), held whole."""

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"capacity must be >= 0 tokens, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self.held_tokens = 0
        self._entries: OrderedDict[object, int] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def use(self, key: object, tokens: int) -> None:
        """``key`` was used: the most recent now, added (evicting the least recent) when it was not held."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        if tokens > self.capacity_tokens:
            return
        while self.held_tokens + tokens > self.capacity_tokens:
            self.held_tokens -= self._entries.popitem(last=False)[1]
        self._entries[key] = tokens
        self.held_tokens += tokens


def _keys(pieces: Sequence[SegmentedPiece], segments: bool) -> list[object]:
    """Each piece's cache key: its chain of pieces so far, or (segment reuse) a named segment's own name."""
    keys: list[object] = []
    chain: tuple[object, ...] = ()
    for p in pieces:
        name = (p.kind, p.ident)
        chain = (chain, name)
        keys.append(("segment", name) if segments and p.segment else chain)
    return keys


def _held(cache: PieceLRU, pieces: Sequence[SegmentedPiece], keys: Sequence[object], segments: bool) -> int:
    """The tokens of ``pieces`` the cache holds by the rule of the module docstring, the cache left as it is."""
    hit = 0
    chain_ok = True  # every piece so far hit
    for p, key in zip(pieces, keys, strict=True):
        ok = key in cache and (chain_ok or (segments and p.segment))
        if ok:
            hit += p.tokens
        chain_ok = chain_ok and ok
    return hit


def _hit(cache: PieceLRU, pieces: Sequence[SegmentedPiece], keys: Sequence[object], segments: bool) -> int:
    """The tokens of ``pieces`` the cache holds by the rule of the module docstring; then every piece is used."""
    hit = _held(cache, pieces, keys, segments)
    for p, key in zip(reversed(pieces), reversed(keys), strict=True):
        cache.use(key, p.tokens)
    return hit


@dataclass(frozen=True)
class Bounds:
    """Token hit of the measured requests at one cache size: prefix caching's and segment reuse's."""

    kv_tokens: int
    prefix: float
    segments: float
    requests: int
    prompt_tokens: int


def bounds(records: Iterable[SegmentedRecord], kv_tokens: Sequence[int], warmup: float = 0.2) -> list[Bounds]:
    """Both bounds at every size of ``kv_tokens`` over one pass of ``records`` (arrival order)."""
    if not 0 <= warmup < 1:
        raise ValueError(f"warmup must be in [0, 1), got {warmup}")
    recs = list(records)
    skip = int(len(recs) * warmup)
    caches = [(PieceLRU(n), PieceLRU(n)) for n in kv_tokens]
    hits = [[0, 0] for _ in kv_tokens]
    prompt = 0
    for i, rec in enumerate(recs):
        pieces = rec.pieces
        plain, named = _keys(pieces, False), _keys(pieces, True)
        measured = i >= skip
        if measured:
            prompt += rec.input_length
        for (prefix_cache, segment_cache), counts in zip(caches, hits, strict=True):
            a = _hit(prefix_cache, pieces, plain, False)
            b = _hit(segment_cache, pieces, named, True)
            if measured:
                counts[0] += a
                counts[1] += b
    n = len(recs) - skip
    return [
        Bounds(size, a / prompt if prompt else 0.0, b / prompt if prompt else 0.0, n, prompt)
        for size, (a, b) in zip(kv_tokens, hits, strict=True)
    ]


def routed(
    records: Iterable[SegmentedRecord],
    nodes: int,
    kv_tokens: int,
    warmup: float = 0.2,
    slack: float = 0.25,
    window: int = 400,
) -> float:
    """Segment reuse's token hit of ``nodes`` caches of ``kv_tokens`` each, every request routed to the node holding
    most of it under a load bound (the module docstring's ``routed`` reference), over one pass of ``records``."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    if not 0 <= warmup < 1:
        raise ValueError(f"warmup must be in [0, 1), got {warmup}")
    recs = list(records)
    skip = int(len(recs) * warmup)
    caches = [PieceLRU(kv_tokens) for _ in range(nodes)]
    recent: deque[int] = deque()
    served = [0] * nodes  # requests each node served among the last ``window``
    hit = prompt = 0
    for i, rec in enumerate(recs):
        pieces = rec.pieces
        keys = _keys(pieces, True)
        limit = (1 + slack) * max(1, len(recent)) / nodes
        allowed = [j for j in range(nodes) if served[j] < limit] or list(range(nodes))
        best = max(allowed, key=lambda j: (_held(caches[j], pieces, keys, True), -served[j], -j))
        got = _hit(caches[best], pieces, keys, True)
        recent.append(best)
        served[best] += 1
        if len(recent) > window:
            served[recent.popleft()] -= 1
        if i >= skip:
            hit += got
            prompt += rec.input_length
    return hit / prompt if prompt else 0.0
