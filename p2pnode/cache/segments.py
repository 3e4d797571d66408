"""Reusable segments of a prompt (retrieved documents, tool outputs): what a request names, how a node finds them in
its tokens, and how ``exact`` mode lays a prompt out so that plain prefix caching reuses them.

Two modes (``SegmentReuse``), both opt-in per request:
- ``exact``: the serving node moves the segments to the front of the prompt (after its BOS), in the order that
  reuses most of its own cache, and the rest of the prompt follows unchanged. The engine serves that layout like any
  prompt, so the output is exactly a full prefill of it; the final message says which order was used. The order
  (``exact_layout``): first the deepest chain of segments the node's cache holds as a prefix (a short search over
  orders of the cached ones), then the others by how often this node has seen them (most first, so the popular
  ones become the cached prefixes of later requests), then by key. Measured on the RAG workload this reuses ~4x the
  tokens of a hash-sorted order (docs/segments.md).
- ``approximate``: segments stay where they are; their stored KV is re-rotated to their new positions
  (``p2pnode/kv/segments.py``). Cross-segment attention is lost, so outputs differ from a full prefill.

A segment's **key** is a hash of its tokens and the request's namespace (adapter, cache salt), never of its position:
the same document has the same key in every prompt, on every node (gossip and routing compare keys).
"""

from __future__ import annotations

import enum
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "KEY_MASK",
    "FrequencySketch",
    "Layout",
    "SegmentReuse",
    "SegmentSpans",
    "exact_layout",
    "find_span",
    "segment_key",
]

#: Keys stay below 2**63: they cross into vLLM's engine core through msgpack as signed 64-bit integers.
KEY_MASK = (1 << 63) - 1
#: Orders ``exact_layout`` tries at most per request (each a prefix-cache lookup).
MAX_LAYOUT_PROBES = 256


class SegmentReuse(enum.Enum):
    NONE = "none"
    EXACT = "exact"
    APPROXIMATE = "approximate"


def _hash(tag: bytes, namespace: str, token_ids: Sequence[int]) -> int:
    digest = hashlib.blake2b(digest_size=8)
    digest.update(tag)
    digest.update(namespace.encode())
    digest.update(b"\0")
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(digest.digest(), "little") & KEY_MASK


def segment_key(namespace: str, token_ids: Sequence[int]) -> int:
    """A segment's key: its tokens under ``namespace`` (model adapter and cache salt), not its position."""
    return _hash(b"segment", namespace, token_ids)


@dataclass(frozen=True, slots=True)
class SegmentSpans:
    """A request's segments as token spans of its prompt: ``spans`` sorted, non-overlapping ``(start, end)``;
    ``keys`` one per span; ``recompute``: approximate mode computes each segment's first tokens (EPIC);
    ``held_elsewhere``: the ones (indices) a peer's gossip says its store holds, as the serving node found them --
    evidence of reuse for its own store's admission (``kv/segments.SegmentStore.offer``)."""

    mode: SegmentReuse
    spans: tuple[tuple[int, int], ...]
    keys: tuple[int, ...]
    recompute: int = 0
    held_elsewhere: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        return sum(end - start for start, end in self.spans)


def find_span(prompt: Sequence[int], segment: Sequence[int], start: int = 0) -> tuple[int, int] | None:
    """Where ``segment`` (a text's tokens, tokenized alone) sits in ``prompt`` from ``start`` on: the first occurrence
    of all of it, else of it without its first and/or last token (a tokenizer may merge a segment's edges with the
    text around it). None when not found."""
    n = len(segment)
    if n == 0:
        return None
    arr = np.asarray(prompt, dtype=np.int64)
    seg = np.asarray(segment, dtype=np.int64)
    if _unit_codable(arr) and _unit_codable(seg):  # a search of bytes: linear in the prompt whatever it holds
        hay = _units(arr)
        for lo, hi in ((0, n), (1, n), (0, n - 1), (1, n - 1)):
            if hi - lo <= 0 or hi - lo > len(arr) - start:
                continue
            at = hay.find(_units(seg[lo:hi]), start * _UNIT)
            if at >= 0:
                return at // _UNIT, at // _UNIT + hi - lo
        return None
    for lo, hi in ((0, n), (1, n), (0, n - 1), (1, n - 1)):  # the definition, for ids the units cannot code
        needle = seg[lo:hi]
        if len(needle) == 0 or len(needle) > len(arr) - start:
            continue
        hits = np.flatnonzero(arr[start : len(arr) - len(needle) + 1] == needle[0]) + start
        for h in hits:
            if np.array_equal(arr[h : h + len(needle)], needle):
                return int(h), int(h + len(needle))
    return None


#: Bytes per token in ``_units``: a marker byte, then the id in 7-bit groups.
_UNIT = 5


def _unit_codable(tokens: np.ndarray) -> bool:
    return not tokens.size or (int(tokens.min()) >= 0 and int(tokens.max()) < 1 << 28)


def _units(tokens: np.ndarray) -> bytes:
    """Each token id (below 2**28) as 5 bytes: 0x80, then its four 7-bit groups (each below 0x80). 0x80 starts a token
    and nothing else, so a sequence's bytes occur only where the sequence does, aligned: ``bytes.find`` (linear time,
    CPython's two-way search) finds a segment in a prompt. Matching token by token took a whole comparison at every
    occurrence of the segment's first token: a prompt of 128k copies of one token and a segment differing from it in
    the middle held the event loop 5.3 s."""
    t = tokens.astype(np.uint32)
    out = np.empty((len(t), _UNIT), dtype=np.uint8)
    out[:, 0] = 0x80
    out[:, 1] = (t >> 21) & 0x7F
    out[:, 2] = (t >> 14) & 0x7F
    out[:, 3] = (t >> 7) & 0x7F
    out[:, 4] = t & 0x7F
    return out.tobytes()


class FrequencySketch:
    """How often this node has seen each segment key, bounded: at most ``capacity`` keys, the least recently seen
    forgotten first; counts halve every ``capacity`` observations so that yesterday's favourites fade."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._counts: OrderedDict[int, float] = OrderedDict()
        self._seen = 0

    def observe(self, keys: Sequence[int]) -> None:
        for key in keys:
            self._counts[key] = self._counts.pop(key, 0.0) + 1.0
            if len(self._counts) > self.capacity:
                self._counts.popitem(last=False)
        self._seen += len(keys)
        while self._seen >= self.capacity:  # a halving per ``capacity`` observations, a batch's overshoot kept
            self._seen -= self.capacity
            for key in self._counts:
                self._counts[key] /= 2

    def __getitem__(self, key: int) -> float:
        return self._counts.get(key, 0.0)


@dataclass(frozen=True, slots=True)
class Layout:
    """An exact-mode layout: ``order`` lists the request's segments (indices) as laid out, ``token_ids`` the prompt
    the engine serves, ``cached`` the tokens the cache lookup promised for it; ``segments_first``: the segments right
    after the head (BOS), so that the first of them is what later requests can reuse as a prefix."""

    order: tuple[int, ...]
    token_ids: list[int]
    cached: int
    segments_first: bool = False


def reuse_weight(recurrence: float, tokens: int) -> float:
    """What a head of a layout promises later requests once it is a cached prefix: how often it recurs times the
    tokens a recurrence would reuse. Recurrence alone misjudges a long system prompt that a few apps share against a
    short popular document: laid behind the document, the prompt is never a cached prefix at all."""
    return recurrence * tokens


def exact_layout(
    prompt: Sequence[int],
    spans: Sequence[tuple[int, int]],
    keys: Sequence[int],
    cached: Callable[[Sequence[int]], int],
    frequency: Callable[[int], float],
    head: int = 0,
    block_size: int = 1,
    lead_key: int | None = None,
    head_frequency: Callable[[int], float] | None = None,
) -> Layout:
    """Lay ``prompt`` out for exact reuse, as whichever of three layouts reuses the most of what ``cached`` (the
    tokens a cache holds of a prompt) says is held:

    - ``prompt[:head]`` (its BOS), then the segments: the deepest chain of them held, then by ``frequency``, then by
      key; then the rest of the prompt in its order;
    - with ``lead_key`` (a key of the text before the first segment, past the head -- a system prompt -- the callers'
      that of its first block, the prefix it shares), that leading text kept in front, then the segments as above,
      then the rest;
    - the prompt as sent (a conversation's earlier turn, laid out as it came).

    The leading text is kept in front when it reuses more, and also when it promises more reuse to later requests
    and is at least as long as what the segments reuse now (what it would give up now it regains at its next
    recurrence). Each head is weighed by ``reuse_weight``: the leading text by how often it recurs (``frequency``:
    every request that has it keeps it in front once it is cached) times its tokens; the segments by the one laid out
    first, by how often it was laid out first (``head_frequency``, default ``frequency``: a document behind a shared
    system prompt recurs there, never as a prefix) times its tokens. So a system prompt a few apps share stays in
    front of documents that recur more often but seldom first -- laid behind them it would never be a cached prefix --
    while documents behind varying contexts, whose leading text never recurs, go first. The prompt as sent is taken
    only when strictly deeper."""
    first_frequency = head_frequency or frequency
    pieces = [list(prompt[s:e]) for s, e in spans]
    probes = 0

    def deepest(start: int) -> tuple[int, tuple[int, ...]]:
        """The deepest chain of segments held behind ``prompt[:start]``: (tokens held, the chain's segments)."""
        nonlocal probes
        head_tokens = list(prompt[:start])
        best: tuple[int, tuple[int, ...]] = (cached(head_tokens) if head_tokens else 0, ())

        def search(order: tuple[int, ...], tokens: list[int]) -> None:
            nonlocal best, probes
            for i in range(len(pieces)):
                if i in order or probes >= MAX_LAYOUT_PROBES:
                    continue
                candidate = tokens + pieces[i]
                probes += 1
                # a lookup leaves a prompt's last token to compute; a prefix the prompt continues past keeps its last
                # full block: one more token (never hashed: it starts a block) lifts that cap where it ends on one
                ends_on_block = len(candidate) % block_size == 0 and len(candidate) < len(prompt)
                depth = cached([*candidate, 0] if ends_on_block else candidate)
                if depth > best[0]:
                    best = (depth, (*order, i))
                if depth > 0 and depth >= len(candidate) // block_size * block_size:  # all of it held: go deeper
                    search((*order, i), candidate)

        search((), head_tokens)
        return best

    def ordered(chosen: tuple[int, ...]) -> tuple[int, ...]:
        rest = sorted((i for i in range(len(pieces)) if i not in chosen), key=lambda i: (-frequency(keys[i]), keys[i]))
        return (*chosen, *rest)

    def lead_promises_more(lead_tokens: int, key: int, chain: tuple[int, ...]) -> bool:
        """Whether the leading text, kept in front, promises later requests more reuse than the segment that would be
        laid first (``chain``: the segments-first layout's cached chain)."""
        front = ordered(chain)[0] if pieces else None
        segments_weight = reuse_weight(first_frequency(keys[front]), len(pieces[front])) if front is not None else 0.0
        return reuse_weight(frequency(key), lead_tokens) > segments_weight

    def laid_out(start: int, chosen: tuple[int, ...], depth: int) -> Layout:
        order = ordered(chosen)
        laid = list(prompt[:start]) + [t for i in order for t in pieces[i]]
        pos = start
        for s, e in spans:
            laid.extend(prompt[pos:s])
            pos = e
        laid.extend(prompt[pos:])
        return Layout(order, laid, depth, start == head and bool(order))

    start, (depth, chosen) = head, deepest(head)
    lead = spans[0][0] if spans else head
    if lead_key is not None and lead > head:
        led = deepest(lead)
        if led[0] > depth or (lead - head >= depth and lead_promises_more(lead - head, lead_key, chosen)):
            start, (depth, chosen) = lead, led
    best = laid_out(start, chosen, depth)
    as_sent = cached(prompt)
    if as_sent > best.cached:
        return Layout(tuple(range(len(spans))), list(prompt), as_sent)
    return best
