"""Sequential replay of a block-access trace through one eviction policy: the model of shadows and yardstick.

Each ``Access`` is one request as a cache sees it: ``blocks``, the full blocks the request leaves cached (prompt
and output), and ``lookup``, how many of its leading blocks can be served from cache (vLLM never reuses the last
prompt token, so ``(prompt_tokens - 1) // block_size``). ``ReplayCache.request`` serves one request at a time and
returns its hit: the longest cached prefix of ``blocks[:lookup]``, the metric the engine reports
(``num_cached_tokens``). Serving is what ``p2pnode/engine/simulated/kvcache.py`` does for a request that runs
alone: the request's cached blocks are pinned (hits, and later blocks already cached), evictions make room for
the missing ones, which enter the cache pinned, and the chain is released tail-first. Concurrency (blocks pinned
by other running requests, space reserved for outputs) is not modelled: every policy and the yardstick
(``belady.py``) see the same sequence, so their hit rates compare like with like.

Invariants: the cache never holds more than ``capacity`` blocks; a request's own blocks are never evicted while
it is served; a request longer than the cache keeps only its first ``capacity`` blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from p2pnode.cache.eviction.base import EvictionPolicy, PolicyFactory

__all__ = ["Access", "ReplayCache", "hit_rate"]


@dataclass(frozen=True, slots=True)
class Access:
    """One request: the blocks it leaves cached, how many leading ones may hit, and its prompt length in blocks.

    ``prompt_blocks`` is ``prompt_tokens / block_size`` (fractional): token-weighted hit rates divide hit blocks by
    it, as the KV hit metric divides cached tokens by prompt tokens.
    """

    blocks: tuple[int, ...]
    lookup: int
    prompt_blocks: float


class ReplayCache:
    """``capacity`` blocks under one policy, serving requests one at a time."""

    __slots__ = ("capacity", "evictions", "policy", "refs")

    def __init__(self, capacity: int, policy: PolicyFactory) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.refs: dict[int, int] = {}  # cached block -> 1 while the request being served holds it, else 0
        self.policy: EvictionPolicy = policy(capacity, self.refs)
        self.evictions = 0

    def request(self, blocks: Sequence[int], lookup: int) -> int:
        """Serve one request; the number of leading blocks of ``blocks[:lookup]`` that were cached."""
        refs = self.refs
        n = min(len(blocks), self.capacity)
        limit = min(lookup, n)
        m = 0
        while m < limit and blocks[m] in refs:
            m += 1
        held: list[int] = []  # cached blocks of this request (the hit prefix, then later copies): pinned
        missing: list[int] = []
        for i in range(n):
            h = blocks[i]
            if h in refs:
                refs[h] = 1
                held.append(h)
            else:
                missing.append(h)
        policy = self.policy
        if held:
            policy.accessed(held)
            policy.pinned(held)
        over = len(refs) + len(missing) - self.capacity
        if over > 0:
            victim = policy.victim
            for _ in range(over):
                del refs[victim()]
            self.evictions += over
        if missing:
            for h in missing:
                refs[h] = 1
            policy.inserted(missing)
        released = [blocks[i] for i in range(n - 1, -1, -1)]
        for h in released:
            refs[h] = 0
        policy.unpinned(released)
        return m


def hit_rate(trace: Sequence[Access], hits: Sequence[int], skip: int = 0) -> float:
    """Token-weighted hit rate of ``hits`` (hit blocks per request) over ``trace[skip:]``."""
    num = sum(hits[skip:])
    den = sum(a.prompt_blocks for a in trace[skip:])
    return num / den if den else 0.0
