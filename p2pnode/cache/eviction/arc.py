"""ARC: two LRU lists -- blocks seen once (T1) and blocks seen again (T2) -- with a target split learned from ghosts.

Source: Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache" (FAST 2003), Fig. 4. A new block
enters T1; a hit moves it to T2. Evicted blocks leave a ghost in B1 (from T1) or B2 (from T2). A new block whose
ghost is in B1 means T1 was too small: the target ``p`` of T1's size grows by max(|B2| / |B1|, 1); a ghost in B2
shrinks it by max(|B1| / |B2|, 1), and such a block goes straight to T2. To evict, ARC takes the least recent block
of T1 when T1 holds more than ``p`` blocks, else of T2. So it leans to recency (LRU) when one-time blocks come back
soon and to frequency when blocks re-read after many others would be pushed out by a scan.

Adapted to a KV cache: recency is release order, as in vLLM's free queue (a block pinned by a running request is
out of T1/T2's evictable order and re-enters at the most recent end when released). ``_list`` remembers every
cached block's list, pinned or not, and ``_n1``/``_n2`` count them, so the split compares the lists' full sizes
as ARC does. Ghost lists are bounded as in the paper: |T1| + |B1| <= c and the total <= 2c. A block removed by
another policy (``adaptive``) leaves a ghost as if ARC had evicted it.

Costs: O(1) per operation (ordered dicts).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

__all__ = ["ARC"]


class ARC:
    name = "arc"

    __slots__ = ("_b1", "_b2", "_c", "_list", "_n1", "_n2", "_p", "_t1", "_t2")

    def __init__(self, capacity_blocks: int, refs: Mapping[int, int]) -> None:
        self._c = max(1, capacity_blocks)
        self._p = 0.0  # target size of T1
        self._t1: OrderedDict[int, None] = OrderedDict()  # evictable blocks seen once, least recent first
        self._t2: OrderedDict[int, None] = OrderedDict()  # evictable blocks seen again
        self._b1: OrderedDict[int, None] = OrderedDict()  # ghosts of T1
        self._b2: OrderedDict[int, None] = OrderedDict()  # ghosts of T2
        self._list: dict[int, int] = {}  # every cached block (pinned too) -> 1 or 2
        self._n1 = 0
        self._n2 = 0

    def inserted(self, hs: Sequence[int]) -> None:
        lst, b1, b2 = self._list, self._b1, self._b2
        for h in hs:
            if h in b1:
                self._p = min(float(self._c), self._p + max(len(b2) / len(b1), 1.0))
                del b1[h]
                lst[h] = 2
                self._n2 += 1
            elif h in b2:
                self._p = max(0.0, self._p - max(len(b1) / len(b2), 1.0))
                del b2[h]
                lst[h] = 2
                self._n2 += 1
            else:
                lst[h] = 1
                self._n1 += 1

    def accessed(self, hs: Sequence[int]) -> None:
        lst, t1, t2 = self._list, self._t1, self._t2
        for h in hs:
            if lst[h] == 1:
                lst[h] = 2
                self._n1 -= 1
                self._n2 += 1
                if h in t1:  # evictable and hit (its pin follows): keep it evictable, now in T2
                    del t1[h]
                    t2[h] = None
            elif h in t2:
                t2.move_to_end(h)

    def pinned(self, hs: Sequence[int]) -> None:
        t1, t2 = self._t1, self._t2
        for h in hs:
            t1.pop(h, None)
            t2.pop(h, None)

    def unpinned(self, hs: Sequence[int]) -> None:
        lst, t1, t2 = self._list, self._t1, self._t2
        for h in hs:
            if lst[h] == 1:
                t1[h] = None
            else:
                t2[h] = None

    def victim(self) -> int:
        t1, t2 = self._t1, self._t2
        from_t1 = bool(t1) and (self._n1 > self._p or not t2)
        h = (t1 if from_t1 else t2).popitem(last=False)[0]
        self._forget(h)
        return h

    def removed(self, hs: Sequence[int]) -> None:
        for h in hs:
            if h in self._list:
                self._t1.pop(h, None)
                self._t2.pop(h, None)
                self._forget(h)

    def _forget(self, h: int) -> None:
        """``h`` left the cache: leave its ghost, keep the ghosts within ARC's bounds."""
        c, b1, b2 = self._c, self._b1, self._b2
        if self._list.pop(h) == 1:
            self._n1 -= 1
            b1[h] = None
            while b1 and self._n1 + len(b1) > c:
                b1.popitem(last=False)
        else:
            self._n2 -= 1
            b2[h] = None
        while b2 and self._n1 + self._n2 + len(b1) + len(b2) > 2 * c:
            b2.popitem(last=False)

    def __len__(self) -> int:
        return len(self._list)
