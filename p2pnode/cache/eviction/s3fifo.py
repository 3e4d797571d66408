"""S3-FIFO: a small probationary FIFO, a main FIFO with reinsertion, and a ghost FIFO of recent evictions.

Source: Yang et al., "FIFO queues are all you need for cache eviction" (SOSP 2023), Algorithm 1, with
libCacheSim's defaults (``S3FIFO.c``): small queue 10% of the cache, ghost 90%, an object moves from the small to
the main queue when it was hit at least ``MOVE_TO_MAIN_THRESHOLD`` = 2 times while in it, frequencies saturate at
3. New blocks enter the small queue, or the main queue when their hash is in the ghost (evicted recently from the
small queue). One-hit wonders -- a scan, a unique prompt's tail -- leave through the small queue without
disturbing the main one; that is S3-FIFO's advantage over LRU, and why LRU can win when reuse comes quickly after
first use (an agent's next step).

Pinned blocks (in use by a running request) cannot be evicted: met at the head of either queue they are parked
aside until their last request releases them, then enter the main queue's tail (promoted, as if accessed). Each
pinned block is met once per pin, so ``victim`` is amortised O(1) however many are pinned (it reinserted them at
main's tail and gave up a pass when it met only pinned ones: with ~90% of the blocks held by running requests, as
under load, every victim walked the whole main queue, ~4 ms a block at 20k blocks). When the main queue is empty
(every block of it parked or gone), victims come from the small queue even below its target size. The queues are
insertion-ordered dicts rather than deques so that ``removed`` (another policy evicted a block, under ``adaptive``)
is O(1) too; a block removed from the small queue enters the ghost as if S3-FIFO had evicted it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

__all__ = ["S3FIFO"]

SMALL_RATIO = 0.10
GHOST_RATIO = 0.90
MOVE_TO_MAIN_THRESHOLD = 2
MAX_FREQ = 3


class S3FIFO:
    name = "s3fifo"

    __slots__ = ("_freq", "_ghost", "_ghost_size", "_main", "_parked", "_refs", "_small", "_small_target")

    def __init__(self, capacity_blocks: int, refs: Mapping[int, int]) -> None:
        self._refs = refs
        self._small: OrderedDict[int, None] = OrderedDict()  # FIFO: oldest first
        self._main: OrderedDict[int, None] = OrderedDict()
        self._ghost: OrderedDict[int, None] = OrderedDict()
        self._parked: dict[int, None] = {}  # pinned blocks victim() met, out of both queues until unpinned
        self._freq: dict[int, int] = {}
        self._small_target = max(1, int(SMALL_RATIO * capacity_blocks))
        self._ghost_size = max(1, int(GHOST_RATIO * capacity_blocks))

    def inserted(self, hs: Sequence[int]) -> None:
        freq, ghost, main, small = self._freq, self._ghost, self._main, self._small
        for h in hs:
            freq[h] = 0
            if h in ghost:  # evicted from the small queue too early: straight to main this time
                del ghost[h]
                main[h] = None
            else:
                small[h] = None

    def accessed(self, hs: Sequence[int]) -> None:
        freq = self._freq
        for h in hs:
            f = freq[h]
            if f < MAX_FREQ:
                freq[h] = f + 1

    def pinned(self, hs: Sequence[int]) -> None:
        pass  # pins are read from the cache's refs at eviction time

    def unpinned(self, hs: Sequence[int]) -> None:
        parked, main = self._parked, self._main
        if parked:
            for h in hs:
                if h in parked:
                    del parked[h]
                    main[h] = None

    def victim(self) -> int:
        refs, freq, small, main, parked = self._refs, self._freq, self._small, self._main, self._parked
        while True:
            if small and (len(small) >= self._small_target or not main):
                h = small.popitem(last=False)[0]
                if refs[h]:
                    parked[h] = None
                    continue
                if freq[h] >= MOVE_TO_MAIN_THRESHOLD:
                    main[h] = None
                    continue
                del freq[h]
                self._ghost_add(h)
                return h
            h = main.popitem(last=False)[0]
            if refs[h]:
                parked[h] = None
                continue
            f = freq[h]
            if f:
                freq[h] = f - 1
                main[h] = None
                continue
            del freq[h]
            return h

    def removed(self, hs: Sequence[int]) -> None:
        small, main, parked, freq = self._small, self._main, self._parked, self._freq
        for h in hs:
            if h in small:
                del small[h]
                self._ghost_add(h)
            elif h in main:
                del main[h]
            elif h in parked:
                del parked[h]
            else:
                continue
            del freq[h]

    def _ghost_add(self, h: int) -> None:
        ghost = self._ghost
        ghost[h] = None
        if len(ghost) > self._ghost_size:
            ghost.popitem(last=False)

    def __len__(self) -> int:
        return len(self._small) + len(self._main) + len(self._parked)
