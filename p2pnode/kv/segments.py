"""Approximate segment reuse (KV-Repurpose): a document's KV computed after one context, reused after another.

vLLM 0.32 can only skip a prompt's **prefix**: the scheduler computes ``[num_computed, num_tokens)`` and a KV
connector may only extend the computed prefix with external tokens (``../shared/KV_CONNECTOR_NOTES.md`` section 2).
So a prompt ``[context][doc1][sep][doc2][question]`` reuses its segments in **phases**:

1. a one-token request over ``[context]`` computes it (its full blocks land in the prefix cache, and the connector
   keeps its last partial block -- the **tail** -- once it ends);
2. the next phase finds ``[context]`` cached up to its last full block, the tail covers the rest, and ``doc1``
   follows from the **store** -- its keys re-rotated from where they were computed to where they now sit
   (``rope.py``) -- so the connector reports ``[...tail][doc1]`` as external tokens and writes them;
3. ``[sep]`` cannot be loaded, so it ends a phase: the phase over ``[context][doc1][sep]`` computes ``sep`` (and
   keeps its tail), and the final request loads ``doc2`` the same way and computes the question.

Each phase runs only up to a segment the store holds, so a prompt with k held segments separated by text costs k
extra one-token requests, and every token is still computed at most once. A segment that was computed (not
loaded) is copied into the store when its request ends, keyed by its own tokens (``segment_key``): position-free,
so the next prompt that holds it anywhere reuses it. Optionally (``recompute``) each segment's first tokens are
always computed, EPIC-style: the phase then ends inside the segment.

What is given up: a loaded segment's KV was computed after another context, so its tokens attend to that context
instead of this one (cross-segment attention is lost); quality is kept on single-document tasks and lost on
cross-document reasoning (KV-Repurpose, CacheBlend). That is why the mode is opt-in, and why such requests run
under their own ``cache_salt``: their blocks never answer an exact-prefix lookup, and salted blocks never reach the
node's index (``engine/kv_events.py`` leaves them out).

Who does what:
- ``SegmentStore`` (the connector's scheduler side): which segments and tails the worker holds, bounded in tokens,
  ordered by one of the node's eviction policies; it decides, so the worker's copy is never consulted. What a request
  computed is *offered* (``offer``): stored once it was offered ``store_threshold`` times (1: at once), so that
  pieces seen once -- a conversation's history named as segments -- do not push documents out; a segment shorter
  than ``MIN_SEGMENT_TOKENS`` is never worth an entry;
- ``plan_loads``: what the store covers of a prompt beyond its cached prefix (pure; the connector's answer to
  ``get_num_new_matched_tokens``);
- ``phase_cuts``: where the node ends its phases, from what it believes the store holds (pure; a wrong belief costs
  a useless phase or a missed load, never a wrong token).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from p2pnode.cache.eviction import get_eviction
from p2pnode.cache.segments import KEY_MASK, segment_key
from p2pnode.config import SEGMENT_SKETCH_KEYS

__all__ = [
    "MIN_SEGMENT_TOKENS",
    "Piece",
    "SegmentStore",
    "StoredSegment",
    "phase_cuts",
    "plan_loads",
    "segment_key",
    "tail_key",
]

#: The store's eviction policy sizes its queues in entries; a segment is counted as this many tokens for that.
POLICY_TOKENS_PER_ENTRY = 512
#: Segments shorter than this are not worth a store entry (a block's worth of tokens at most): the connector never
#: stores one, nor does the simulator.
MIN_SEGMENT_TOKENS = 16


def tail_key(namespace: str, prompt_token_ids: Sequence[int]) -> int:
    """The key of the tail of a phase over exactly ``prompt_token_ids`` (position-bound: the whole prefix)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(b"tail")
    digest.update(namespace.encode())
    digest.update(b"\0")
    digest.update(np.asarray(prompt_token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(digest.digest(), "little") & KEY_MASK


@dataclass
class StoredSegment:
    """A run of tokens whose KV the worker holds; its keys were rotated at positions ``start..``."""

    key: int
    tokens: tuple[int, ...]
    start: int
    pins: int = 0


@dataclass(frozen=True, slots=True)
class Piece:
    """Load ``count`` tokens from entry ``key`` (from its token ``offset``) to prompt positions ``dst..``, keys
    rotated by ``delta`` positions."""

    key: int
    offset: int
    dst: int
    count: int
    delta: int
    tail: bool = False


class SegmentStore:
    """The store's contents as the connector's scheduler side decides them.

    Invariants: ``held_tokens`` <= ``capacity_tokens``; a pinned entry (a request is loading from it) is never
    evicted; every entry the policy knows is held, and the policy orders exactly the unpinned ones. Tails live apart
    (at most ``max_tails`` besides the pinned ones and the one just added, oldest unpinned first out): they serve only
    the next phase of one prompt. Offers of segments not held yet are counted for ``store_threshold`` (the last
    ``offer_keys`` keys offered; a key forgotten starts again from one).
    """

    def __init__(
        self,
        capacity_tokens: int,
        policy: str = "lru",
        max_tails: int = 256,
        store_threshold: int = 1,
        offer_keys: int = SEGMENT_SKETCH_KEYS,
    ) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
        if store_threshold < 1:
            raise ValueError(f"store_threshold must be >= 1, got {store_threshold}")
        self.capacity_tokens = capacity_tokens
        self.max_tails = max_tails
        self.store_threshold = store_threshold
        self._offer_keys = offer_keys
        self._offers: OrderedDict[int, int] = OrderedDict()  # key not held -> times offered
        self.held_tokens = 0
        self._entries: dict[int, StoredSegment] = {}
        self._refs: dict[int, int] = {}  # every held key -> its pins (the policies read it)
        self._policy = get_eviction(policy)(max(8, capacity_tokens // POLICY_TOKENS_PER_ENTRY), self._refs)
        self._tails: OrderedDict[int, StoredSegment] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def keys(self) -> list[int]:
        return list(self._entries)

    def get(self, key: int, tokens: Sequence[int]) -> StoredSegment | None:
        """The entry ``key`` when it holds exactly ``tokens`` (a hash collision is a miss)."""
        entry = self._entries.get(key)
        return entry if entry is not None and entry.tokens == tuple(tokens) else None

    def tail(self, key: int, start: int, tokens: Sequence[int]) -> StoredSegment | None:
        entry = self._tails.get(key)
        return entry if entry is not None and entry.start == start and entry.tokens == tuple(tokens) else None

    def admit(self, key: int, tokens: Sequence[int], start: int) -> tuple[bool, list[int]]:
        """Hold a new segment, evicting as its policy orders: whether it is held now, and the keys evicted for it
        (it cannot fit when larger than the store or when what it would need to evict is pinned)."""
        size = len(tokens)
        if key in self._entries or size == 0 or size > self.capacity_tokens:
            return False, []
        if self.held_tokens + size > self.capacity_tokens:
            evictable = sum(len(e.tokens) for e in self._entries.values() if not e.pins)
            if self.held_tokens - evictable + size > self.capacity_tokens:
                return False, []
        evicted: list[int] = []
        while self.held_tokens + size > self.capacity_tokens:
            victim = self._policy.victim()
            gone = self._entries.pop(victim)
            self._refs.pop(victim, None)
            self.held_tokens -= len(gone.tokens)
            evicted.append(victim)
        self._entries[key] = StoredSegment(key, tuple(tokens), start)
        self.held_tokens += size
        self._refs[key] = 1  # the policies' protocol: a new entry arrives pinned by its writer, then is released
        self._policy.inserted([key])
        self._refs[key] = 0
        self._policy.unpinned([key])
        return True, evicted

    def offer(
        self, key: int, tokens: Sequence[int], start: int, held_elsewhere: bool = False
    ) -> tuple[bool, list[int]]:
        """A request computed segment ``key``: ``admit`` it when this is its ``store_threshold``-th offer (a pulled
        segment is admitted directly: its bytes are here already). ``held_elsewhere``: a peer's gossiped segment keys
        say its store holds the segment -- the mesh computed it before, which counts as one offer more (evidence of
        reuse across the mesh, where routing spreads a request's documents over the nodes)."""
        if len(tokens) < MIN_SEGMENT_TOKENS or key in self._entries:
            return False, []
        if self.store_threshold > 1:
            offers = self._offers.pop(key, 0) + 1
            if offers + held_elsewhere < self.store_threshold:
                self._count(key, offers)
                return False, []
            held, evicted = self.admit(key, tokens, start)
            if not held:  # no room now (pinned entries): the next offer tries again
                self._count(key, offers - 1)
            return held, evicted
        return self.admit(key, tokens, start)

    def _count(self, key: int, offers: int) -> None:
        self._offers[key] = offers
        while len(self._offers) > self._offer_keys:
            self._offers.popitem(last=False)

    def add_tail(self, key: int, tokens: Sequence[int], start: int) -> list[int]:
        """Hold a phase's tail; the tails dropped to make room."""
        dropped: list[int] = []
        if key in self._tails:
            self._tails.move_to_end(key)
            return dropped
        self._tails[key] = StoredSegment(key, tuple(tokens), start)
        for old in list(self._tails):
            if len(self._tails) <= self.max_tails:
                break
            # never the tail just added: its KV is captured after this returns, and a tail dropped before it was
            # captured stayed in the worker for good (every older tail pinned: past max_tails until they unpin)
            if old != key and not self._tails[old].pins:
                del self._tails[old]
                dropped.append(old)
        return dropped

    def pin(self, keys: Sequence[int]) -> None:
        for key in keys:
            entry = self._entries.get(key) or self._tails.get(key)
            if entry is None:
                continue
            entry.pins += 1
            if key in self._entries:
                self._policy.accessed([key])
                if entry.pins == 1:
                    self._policy.pinned([key])
                self._refs[key] = entry.pins

    def unpin(self, keys: Sequence[int]) -> None:
        for key in keys:
            entry = self._entries.get(key) or self._tails.get(key)
            if entry is None or entry.pins == 0:
                continue
            entry.pins -= 1
            if key in self._entries:
                self._refs[key] = entry.pins
                if not entry.pins:
                    self._policy.unpinned([key])


def plan_loads(
    prompt: Sequence[int],
    computed: int,
    spans: Sequence[tuple[int, int]],
    keys: Sequence[int],
    store: SegmentStore,
    block_size: int,
    namespace: str,
    recompute: int = 0,
) -> list[Piece]:
    """What the store covers of ``prompt`` from token ``computed`` on (the engine's cached prefix), contiguously:
    held segments (from their first token past ``recompute``) and, before each, a tail that bridges a partial block.
    Stops at the first token nothing covers, and before the prompt's last token (the engine computes at least one)."""
    pos = computed
    limit = len(prompt) - 1
    pieces: list[Piece] = []
    for (start, end), key in zip(spans, keys, strict=True):
        if end <= pos:
            continue
        boundary = min(end, start + recompute)
        if pos < boundary:
            bridge = boundary - pos
            if pos % block_size or bridge >= block_size:
                break
            entry = store.tail(tail_key(namespace, prompt[:boundary]), pos, prompt[pos:boundary])
            if entry is None:
                break
            pieces.append(Piece(entry.key, 0, pos, bridge, 0, tail=True))
            pos = boundary
        if pos >= end:
            continue
        entry = store.get(key, prompt[start:end])
        if entry is None:
            break
        pieces.append(Piece(key, pos - start, pos, end - pos, start - entry.start))
        pos = end
    # the engine computes the prompt's last token itself
    while pieces and pieces[-1].dst + pieces[-1].count > limit:
        last = pieces.pop()
        keep = limit - last.dst
        if keep > 0:
            pieces.append(Piece(last.key, last.offset, last.dst, keep, last.delta, last.tail))
    return pieces


def phase_cuts(spans: Sequence[tuple[int, int]], held: Callable[[int], bool], recompute: int = 0) -> list[int]:
    """Where the node ends its phases before the final request: before each held segment (at its first loadable
    token) that does not directly follow another loaded one. ``held(i)``: the node believes segment i is stored."""
    cuts: list[int] = []
    loaded_to = -1  # where the last loaded segment ends
    for i, (start, end) in enumerate(spans):
        boundary = min(end, start + recompute)
        if boundary >= end or not held(i):
            continue
        if boundary != loaded_to and boundary > 0:
            cuts.append(boundary)
        loaded_to = end
    return cuts
