"""Several policies over one cache, one of them choosing the victims: a policy that can change at run time in O(1).

Every candidate sees every event of the real cache (inserts, hits, pins, releases), so each keeps its own order
of the blocks actually cached -- its frequency counts, ghosts and queues stay warm. Only the active one is asked
for victims; the others are told the victim is gone (``removed``). Switching is then a pointer change: the new
policy's very next victim is the one it would choose over the current contents, with its history intact, and no
block moves, so nothing is evicted or re-announced because of a switch.

Costs: every operation is done once per policy held (the engine holds all four: ~4x one policy's CPU and memory).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from p2pnode.cache.eviction.base import EvictionPolicy, PolicyFactory

__all__ = ["Switchable"]


class Switchable:
    """The candidates of ``factories`` over one cache; ``active`` picks victims, ``switch(name)`` changes it."""

    name = "switchable"

    def __init__(
        self, capacity_blocks: int, refs: Mapping[int, int], factories: Mapping[str, PolicyFactory], active: str
    ) -> None:
        if active not in factories:
            raise ValueError(f"active policy {active!r} is not a candidate ({', '.join(factories)})")
        self.policies: dict[str, EvictionPolicy] = {n: f(capacity_blocks, refs) for n, f in factories.items()}
        self._all = tuple(self.policies.values())
        self.active_name = active
        self._active = self.policies[active]
        self._others = tuple(p for n, p in self.policies.items() if n != active)
        self.switches = 0

    def switch(self, name: str) -> bool:
        """Make ``name`` the policy that picks victims; False when it already was. ValueError if not a candidate."""
        if name not in self.policies:
            raise ValueError(f"unknown eviction policy {name!r}; candidates: {', '.join(self.policies)}")
        if name == self.active_name:
            return False
        self.active_name = name
        self._active = self.policies[name]
        self._others = tuple(p for n, p in self.policies.items() if n != name)
        self.switches += 1
        return True

    def inserted(self, hs: Sequence[int]) -> None:
        for p in self._all:
            p.inserted(hs)

    def accessed(self, hs: Sequence[int]) -> None:
        for p in self._all:
            p.accessed(hs)

    def pinned(self, hs: Sequence[int]) -> None:
        for p in self._all:
            p.pinned(hs)

    def unpinned(self, hs: Sequence[int]) -> None:
        for p in self._all:
            p.unpinned(hs)

    def victim(self) -> int:
        h = self._active.victim()
        gone = (h,)
        for p in self._others:
            p.removed(gone)
        return h

    def removed(self, hs: Sequence[int]) -> None:
        for p in self._all:
            p.removed(hs)
