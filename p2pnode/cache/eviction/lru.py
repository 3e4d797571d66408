"""LRU over released blocks: vLLM's free-block queue.

vLLM's v1 block pool keeps every block with ``ref_cnt == 0`` in a doubly linked free queue: a freed block goes to
the tail, a cache hit takes the block out of the queue, and allocation evicts from the head. So the order is
"least recently released first", and pinned blocks are not in the queue at all. The simulated cache releases a
finished request's blocks tail-first (as vLLM's ``free`` does, ``reversed(blocks)``), so a chain's deepest blocks
are evicted before its shared prefix.

Costs: O(1) per operation (an OrderedDict used as a linked list); a batch's blocks in one C call where the extension
is built (``p2pnode/block_loops.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from p2pnode.block_loops import delete_keys, set_none

__all__ = ["LRU"]


class LRU:
    name = "lru"

    __slots__ = ("_free",)

    def __init__(self, capacity_blocks: int, refs: Mapping[int, int]) -> None:
        self._free: OrderedDict[int, None] = OrderedDict()  # evictable blocks, least recently released first

    def inserted(self, hs: Sequence[int]) -> None:
        pass  # pinned on arrival: enters the queue when released

    def accessed(self, hs: Sequence[int]) -> None:
        pass  # recency is release order

    def pinned(self, hs: Sequence[int]) -> None:
        delete_keys(self._free, hs)

    def unpinned(self, hs: Sequence[int]) -> None:
        set_none(self._free, hs)  # (not OrderedDict.update: ~4x slower than a loop)

    def victim(self) -> int:
        return self._free.popitem(last=False)[0]

    def removed(self, hs: Sequence[int]) -> None:
        free = self._free
        for h in hs:
            free.pop(h, None)

    def __len__(self) -> int:
        return len(self._free)
