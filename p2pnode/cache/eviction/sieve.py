"""SIEVE: one FIFO queue, a visited bit per block, and a hand that sweeps from the oldest block towards the newest.

Source: Zhang et al., "SIEVE is Simpler than LRU: an Efficient Turn-Key Eviction Algorithm for Web Caches"
(NSDI 2024), Algorithm 1. New blocks enter at the head (newest); a hit only sets the block's visited bit (no move);
to evict, the hand walks from where it stopped towards the head, clearing visited bits, and evicts the first
unvisited block; past the head it wraps to the tail. Blocks that survive a sweep keep their place, so popular
blocks settle behind the hand while new one-time blocks are evicted in FIFO order: "lazy promotion, quick
demotion", the same idea as S3-FIFO with one queue. It covers the regime where reuse comes after many other
requests (a popular prompt re-read between scans) without S3-FIFO's small probationary queue, which evicts a
block whose second use comes late (an agent's next step) before it was ever promoted.

Pinned blocks (in use by a running request) are passed over like visited ones, without clearing the bit. The
cache only asks for a victim when an evictable block exists, so the sweep ends within two passes.

Costs: O(1) per insert and hit; eviction is amortised O(1) (each sweep step clears a bit set by a hit). The queue
is a doubly linked list in two dicts (``_newer``, ``_older``: block -> neighbour) so ``removed`` is O(1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["SIEVE"]


class SIEVE:
    name = "sieve"

    __slots__ = ("_hand", "_head", "_newer", "_older", "_refs", "_tail", "_visited")

    def __init__(self, capacity_blocks: int, refs: Mapping[int, int]) -> None:
        self._refs = refs
        self._newer: dict[int, int | None] = {}  # block -> the next newer block (None at the head)
        self._older: dict[int, int | None] = {}  # block -> the next older block (None at the tail)
        self._head: int | None = None  # newest
        self._tail: int | None = None  # oldest
        self._hand: int | None = None  # where the next sweep starts (None: at the tail)
        self._visited: set[int] = set()

    def inserted(self, hs: Sequence[int]) -> None:
        newer, older = self._newer, self._older
        for h in hs:
            head = self._head
            newer[h] = None
            older[h] = head
            if head is None:
                self._tail = h
            else:
                newer[head] = h
            self._head = h

    def accessed(self, hs: Sequence[int]) -> None:
        self._visited.update(hs)

    def pinned(self, hs: Sequence[int]) -> None:
        pass  # pins are read from the cache's refs during the sweep

    def unpinned(self, hs: Sequence[int]) -> None:
        pass

    def victim(self) -> int:
        refs, visited, newer = self._refs, self._visited, self._newer
        h = self._hand if self._hand is not None else self._tail
        while True:
            assert h is not None, "victim() on a policy with no blocks"
            if refs[h] or h in visited:
                if not refs[h]:
                    visited.discard(h)
                nxt = newer[h]
                h = nxt if nxt is not None else self._tail
                continue
            self._hand = newer[h]
            self._unlink(h)
            return h

    def removed(self, hs: Sequence[int]) -> None:
        for h in hs:
            if h in self._newer:
                if self._hand == h:
                    self._hand = self._newer[h]
                self._visited.discard(h)
                self._unlink(h)

    def _unlink(self, h: int) -> None:
        nw = self._newer.pop(h)
        od = self._older.pop(h)
        if nw is None:
            self._head = od
        else:
            self._older[nw] = od
        if od is None:
            self._tail = nw
        else:
            self._newer[od] = nw

    def __len__(self) -> int:
        return len(self._newer)
