"""Belady's MIN over a block-access trace: the yardstick no online policy can beat, computed offline.

Source: Belady, "A study of replacement algorithms for a virtual-storage computer" (IBM Systems Journal, 1966):
evict the block whose next use is farthest in the future. Here the trace is the one ``replay.ReplayCache`` serves
(same pinning, same forced insertion of every computed block), and a block's "next use" is the next request that
can *hit* it (it lies within that request's ``lookup``); a block never hit again goes first. Ties evict the deeper
block of its chain: a descendant is never hit before its ancestor (any request that hits it hits the ancestor
too), so MIN keeps the cache prefix-closed and every cached block is reachable by a prefix match -- which is why
MIN's block hits equal its prefix hits, the metric every policy is judged by (a test checks MIN against an
exhaustive search on small traces).

Costs: O(total blocks x log(cache)) with a lazy heap; the next uses are computed in one backward pass.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from p2pnode.cache.eviction.replay import Access

__all__ = ["belady_hits"]

_NEVER = 1 << 62


def _next_uses(trace: Sequence[Access], capacity: int) -> list[list[int]]:
    """``out[i][k]``: the index of the next request after i that can hit ``trace[i].blocks[k]`` (or _NEVER)."""
    nxt: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in trace]
    for i in range(len(trace) - 1, -1, -1):
        a = trace[i]
        blocks = a.blocks[:capacity]
        out[i] = [nxt.get(h, _NEVER) for h in blocks]
        for k in range(min(a.lookup, len(blocks))):
            nxt[blocks[k]] = i
    return out


def belady_hits(trace: Sequence[Access], capacity: int) -> list[int]:
    """Hit blocks of each request of ``trace`` in a cache of ``capacity`` blocks under Belady's MIN."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    uses = _next_uses(trace, capacity)
    key: dict[int, tuple[int, int]] = {}  # cached block -> (next use, depth), its current heap key
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block), stale entries skipped
    hits: list[int] = []
    for i, a in enumerate(trace):
        blocks = a.blocks[:capacity]
        n = len(blocks)
        limit = min(a.lookup, n)
        m = 0
        while m < limit and blocks[m] in key:
            m += 1
        hits.append(m)
        pinned = set(blocks)
        missing = [h for h in blocks if h not in key]
        over = len(key) + len(missing) - capacity
        while over > 0:
            neg_next, neg_depth, h = heapq.heappop(heap)
            if key.get(h) != (-neg_next, -neg_depth) or h in pinned:
                continue  # stale, or this request's block (its entry is renewed below)
            del key[h]
            over -= 1
        for k, h in enumerate(blocks):
            entry = (uses[i][k], k)
            key[h] = entry
            heapq.heappush(heap, (-entry[0], -k, h))
        if len(heap) > 4 * capacity + 1024:  # drop stale entries now and then: memory stays O(capacity)
            heap = [(-e[0], -e[1], h) for h, e in key.items()]
            heapq.heapify(heap)
    return hits
