"""Reuse beyond prefixes in the simulated engine: a request's segments (retrieved documents) reused in ``exact`` or
``approximate`` mode, by the node's own rules, one ``SimSegments`` per node.

**exact** (``cache/segments.exact_layout``, what a serving node does in ``serving/segments.SegmentLayouts``): when a
request reaches its serving node, its prompt is laid out against that node's cache -- the deepest chain of its
segments the cache holds first, then the others by how often this node saw them (the node's ``FrequencySketch``),
then the rest of the prompt -- and the engine serves the laid-out prompt like any other: its cached prefix is its
hit, and it caches what it computes. No BOS is kept first (the simulated prompts have none).

**approximate** (``kv/segments.py``, what the connector does): each node keeps a ``SegmentStore`` -- the connector's own
bookkeeping, bounded in tokens, ordered by the node's segment policy (``SimConfig.segment_policy``) -- beside its paged
prefix cache. Every approximate request runs under the approximate cache salt: its blocks hash in their own namespace
(``APPROXIMATE_ROOT``), so they only ever answer other approximate requests and never reach the node's index
(``kvcache.hidden``). At admission the request reuses its salted cached prefix like any prefix, and every segment the
store holds past that prefix is **loaded**: its tokens count as cached for the request (its hit) and are not prefilled
(``SimRequest.loaded_tokens``); the load itself -- host to GPU, the keys' re-rotation -- costs nothing here. The loaded
entries are pinned until the request ends (the connector pins what it loads); then every segment it computed is offered
to the store (``SegmentStore.offer``, as the connector offers it): stored once offered ``store_threshold`` times (a
peer's gossiped keys holding it count as one: ``SegmentedPrompt.held_elsewhere``), evicting by the policy, and never
when shorter than the connector stores (``MIN_SEGMENT_TOKENS``).

**Phases** (``kv/segments.phase_cuts``): a held segment that does not follow the cached prefix or another loaded
segment is reached by a one-token request over the prompt up to it, so a prompt with k such segments runs k phases
before its final request, each computing the text up to its cut. Modelled as stops in the request's prefill: a step
never computes across a cut (``SimRequest.phase_stops``), so the k phases cost at least k more engine steps before
the first token, and every token is still computed once. This is a lower bound of their cost: in vLLM each phase is
a request of its own that queues behind the waiting ones, and a phase whose text is all cached still computes its
last token (here it costs nothing).

**Pulled segments** (the simulator's ``sim/pulls.py``; only with a link figure): a segment the serving node's store
lacks may have been pulled from a peer's store before the request joined the queue (``SegmentedPrompt.pulled``); at
admission it loads like a held one -- the same phases, the same tokens not prefilled -- and its loaded tokens are
counted as pulled (``SimRequest.pulled_tokens``), not as the node's own hit. A pulled segment is not stored at the
serving node (``store_pulled`` False, the default): the holder keeps the one copy and the mesh's stores keep more
distinct documents (docs/segments.md, "Moving segments between nodes").

Capacity: an approximate node's KV is split between the paged cache and the store by the run (``sim/cluster.py``,
``DEFAULT_SIM_SEGMENT_STORE_SHARE``), so every mode holds the same tokens of KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.segments import FrequencySketch, SegmentReuse, SegmentSpans, exact_layout, segment_key
from p2pnode.config import (
    DEFAULT_SEGMENT_POLICY,
    DEFAULT_SEGMENT_STORE_THRESHOLD,
    EVICTION_POLICY_NAMES,
    SEGMENT_SKETCH_KEYS,
)
from p2pnode.engine.simulated.kvcache import PagedPrefixCache
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.kv.segments import SegmentStore, phase_cuts

__all__ = ["APPROXIMATE_ROOT", "SegmentedPrompt", "SimSegments", "segment_key"]

#: The root of an approximate request's block chain: its cache salt (any value apart from the plain chain's root).
APPROXIMATE_ROOT = int.from_bytes(b"p2pnsalt", "big")


@dataclass(slots=True, eq=False)
class SegmentedPrompt:
    """A request's real tokens (prompt, then output) and its segments; what reuse did to it."""

    tokens: list[int]
    spans: tuple[tuple[int, int], ...]
    keys: tuple[int, ...]
    #: How this run reuses them (``NONE``: the prompt is served as it is, prefix caching only).
    mode: SegmentReuse = SegmentReuse.NONE
    recompute: int = 0
    #: Its blocks are under the approximate cache salt (set at its serving node).
    salted: bool = False
    #: exact: the segments' order in the layout; approximate: the phases run, the segments loaded (indices).
    order: tuple[int, ...] = ()
    phases: int = 0
    loaded: tuple[int, ...] = ()
    #: approximate: the segments pulled from peers' stores before admission (indices; ``sim/pulls.py``).
    pulled: tuple[int, ...] = ()
    #: approximate: the segments a peer's gossiped keys said it held when the request reached its serving node
    #: (indices): evidence of reuse for the store's admission (``SegmentStore.offer``).
    held_elsewhere: frozenset[int] = frozenset()

    def spans_for_routing(self) -> SegmentSpans | None:
        """What the ingress's router is told (None when the run reuses prefixes only)."""
        if self.mode is SegmentReuse.NONE:
            return None
        return SegmentSpans(self.mode, self.spans, self.keys, self.recompute)


class SimSegments:
    """One node's segment reuse (module docstring); ``store_tokens`` > 0 only for approximate runs."""

    def __init__(
        self,
        cache: PagedPrefixCache,
        store_tokens: int = 0,
        policy: str = DEFAULT_SEGMENT_POLICY,
        sketch_keys: int = SEGMENT_SKETCH_KEYS,
        store_pulled: bool = False,
        store_threshold: int = DEFAULT_SEGMENT_STORE_THRESHOLD,
    ) -> None:
        self.cache = cache
        self.store_pulled = store_pulled
        self.seen = FrequencySketch(sketch_keys)
        self.heads = FrequencySketch(sketch_keys)  # how often each segment was laid out first (exact)
        store_policy = policy if policy in EVICTION_POLICY_NAMES else DEFAULT_SEGMENT_POLICY
        self.store = None
        if store_tokens > 0:
            self.store = SegmentStore(store_tokens, store_policy, store_threshold=store_threshold)
        #: The store's keys -> tokens, in the store's order (oldest first).
        self.sizes: dict[int, int] = {}
        #: Counters: segments stored, and evicted from the store.
        self.stored = 0
        self.evicted = 0

    # --- what routing and gossip read ------------------------------------------------------------------------

    def holds(self, key: int) -> bool:
        """Whether the store holds segment ``key`` (the node's ``holds_segment``)."""
        return self.store is not None and key in self.store

    def keys(self) -> list[int]:
        """The store's keys, oldest first (what the node gossips the newest of)."""
        return list(self.sizes)

    def holdings(self) -> dict[int, int]:
        """The store's keys -> tokens, oldest first (``VllmEngine.segment_holdings``'s shape)."""
        return dict(self.sizes)

    # --- a request's life ------------------------------------------------------------------------------------

    def arrive(self, r: SimRequest) -> None:
        """``r`` reached this node: lay it out (exact) or put it under the salt (approximate)."""
        seg = r.segments
        if seg is None or seg.mode is SegmentReuse.NONE:
            return
        bs = self.cache.block_size
        if seg.mode is SegmentReuse.APPROXIMATE:
            seg.salted = True
            r.chain = block_hashes(seg.tokens, bs, APPROXIMATE_ROOT)
            return
        cache = self.cache

        def cached(candidate: Sequence[int]) -> int:
            chain = block_hashes(list(candidate), bs)
            return cache.match_blocks(chain, len(chain)) * bs

        prompt = r.prompt_tokens
        lead = seg.spans[0][0] if seg.spans else 0
        lead_key = segment_key("", seg.tokens[: min(lead, bs)]) if lead > 0 else None  # as the node counts its lead
        layout = exact_layout(
            seg.tokens[:prompt], seg.spans, seg.keys, cached, self.seen.__getitem__, block_size=bs, lead_key=lead_key,
            head_frequency=self.heads.__getitem__,
        )
        self.seen.observe(seg.keys if lead_key is None else (*seg.keys, lead_key))
        if layout.segments_first:
            self.heads.observe((seg.keys[layout.order[0]],))
        seg.tokens = layout.token_ids + seg.tokens[prompt:]
        seg.order = layout.order
        r.chain = block_hashes(seg.tokens, bs)

    def _plan(self, r: SimRequest, seg: SegmentedPrompt, computed: int) -> tuple[list[int], list[int], list[int]]:
        """For an approximate request whose prefix is cached up to token ``computed``: the tokens each segment would
        load, the held segments, and the phases' cuts."""
        store = self.store
        tokens, spans, recompute = seg.tokens, seg.spans, seg.recompute
        limit = r.prompt_tokens - 1  # the engine computes the prompt's last token itself
        pulled = seg.pulled
        held = [
            i for i, ((start, end), key) in enumerate(zip(spans, seg.keys, strict=True))
            if i in pulled or (store is not None and store.get(key, tokens[start:end]) is not None)
        ]
        amounts = [0] * len(spans)
        for i in held:
            start, end = spans[i]
            lo, hi = max(start + recompute, computed), min(end, limit)
            if hi > lo:
                amounts[i] = hi - lo
        wanted = set(held)
        cuts = [c for c in phase_cuts(spans, wanted.__contains__, recompute) if c < limit]
        return amounts, held, cuts

    def expected_loads(self, r: SimRequest, computed: int) -> int:
        """The tokens ``r`` would load if admitted now with its prefix cached up to ``computed`` (its backlog)."""
        seg = r.segments
        if seg is None or seg.mode is not SegmentReuse.APPROXIMATE or self.store is None:
            return 0
        return sum(self._plan(r, seg, computed)[0])

    def admit(self, r: SimRequest) -> None:
        """``r`` was admitted with its cached prefix (``r.cached_tokens``): load what the store holds past it, and
        set its phases' stops (module docstring)."""
        seg = r.segments
        if seg is None or seg.mode is not SegmentReuse.APPROXIMATE or self.store is None:
            return
        computed = r.cached_tokens
        amounts, held, cuts = self._plan(r, seg, computed)
        loaded = sum(amounts)
        r.loaded_tokens = loaded
        seg.loaded = tuple(i for i in held if amounts[i])
        if seg.pulled:
            r.pulled_tokens += sum(amounts[i] for i in seg.pulled)
        seg.phases = len(cuts)
        self.store.pin([seg.keys[i] for i in seg.loaded])
        work = r.prompt_tokens - computed - loaded
        stops: set[int] = set()
        spans = seg.spans
        for cut in cuts:  # the tokens computed before each cut: the text up to it past the prefix, less what loads
            before = max(0, cut - computed) - sum(a for a, (_, end) in zip(amounts, spans, strict=True) if end <= cut)
            if 0 < before < work:
                stops.add(work - before)
        r.phase_stops = sorted(stops, reverse=True) if stops else None

    def finish(self, r: SimRequest) -> None:
        """``r`` ended after its prefill: unpin what it loaded, store the segments it computed (and those it pulled,
        with ``store_pulled``)."""
        seg = r.segments
        store = self.store
        if seg is None or seg.mode is not SegmentReuse.APPROXIMATE or store is None:
            return
        store.unpin([seg.keys[i] for i in seg.loaded])
        skip = set(seg.loaded).difference(seg.pulled)  # loaded from this store: held already
        if not self.store_pulled:
            skip.update(seg.pulled)
        for i, ((start, end), key) in enumerate(zip(seg.spans, seg.keys, strict=True)):
            if i in skip or key in store:
                continue
            # a pulled segment's bytes are here: admitted at once, as the node's connector does; a computed one offered,
            # a peer's holding it counted as evidence
            if i in seg.pulled:
                held, evicted = store.admit(key, seg.tokens[start:end], start)
            else:
                held, evicted = store.offer(key, seg.tokens[start:end], start, i in seg.held_elsewhere)
            if held:
                self.sizes[key] = end - start
                self.stored += 1
            for gone in evicted:
                self.sizes.pop(gone, None)
            self.evicted += len(evicted)
