"""What a KV cache asks of an eviction policy.

The cache owns the set of cached blocks and their pin counts (``refs``: block key -> number of running requests
using it); a policy only orders them. A pinned block (refs > 0) is in use by a running request and can never be
evicted, exactly as vLLM's block pool never frees a block with ``ref_cnt > 0``. Three caches drive the same
policies: the simulator's (``p2pnode/engine/simulated/kvcache.py``), the sequential replay of the shadow caches and
of ``scripts/eviction_eval.py`` (``replay.py``), and vLLM's free-block queue inside the engine process
(``p2pnode/engine/eviction_hook.py``).

Protocol, driven by the cache, in batches (one call per request event, not per block: the simulator's hot path):
- ``inserted(hs)``: new blocks entered the cache (pinned by the request that computed them);
- ``accessed(hs)``: a request reused these cached blocks (pinned or not);
- ``pinned(hs)``: of those, the ones that were evictable and no longer are;
- ``unpinned(hs)``: the last request using each of ``hs`` released it, in release order (a chain's tail first);
- ``victim()``: remove an evictable block from the policy and return it. The cache calls it only when at least one
  evictable block exists, so a policy may rely on that to terminate;
- ``removed(hs)``: these evictable blocks left the cache by someone else's choice (``adaptive`` runs every
  candidate over the real cache and only the active one picks victims; the others forget them as if they had
  evicted them, so any of them can take over at once).

Invariant every policy keeps: ``victim()`` returns a block that is cached and unpinned, never one it already gave
up (by ``victim`` or ``removed``); what it remembers beyond the cached blocks (a ghost list) is bounded by a multiple
of the capacity.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

__all__ = ["EvictionPolicy", "PolicyFactory"]


class EvictionPolicy(Protocol):
    name: str

    def inserted(self, hs: Sequence[int]) -> None: ...

    def accessed(self, hs: Sequence[int]) -> None: ...

    def pinned(self, hs: Sequence[int]) -> None: ...

    def unpinned(self, hs: Sequence[int]) -> None: ...

    def victim(self) -> int: ...

    def removed(self, hs: Sequence[int]) -> None: ...


#: ``factory(capacity_blocks, refs)``: refs is the cache's live pin-count map (read-only for the policy).
PolicyFactory = Callable[[int, Mapping[int, int]], EvictionPolicy]
