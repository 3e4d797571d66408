"""A node's exact indexes of its KV, one per medium, and how deep a prompt's prefix reaches through them.

The engine's own cache keeps its ``PrefixIndex`` (the one gossip summarises and routing has always read); each tier
the engine runs -- host memory, disk -- gets one more, fed by the same KV events, told apart by their ``medium``. A
block may sit in several media at once (the engine keeps a block it stored to its tier), each index counting its own
copies.

``match_tiers`` answers what a request would reuse on this node, as vLLM would serve it: the engine's prefix-cache hit,
then the blocks its host tier holds right after it (vLLM's offloading connector loads one contiguous run, each block
from the tier: a block the engine holds past a gap is not loaded, so it does not count), then those the disk tier
holds after that.

A tier's events come in any order: vLLM's offloading connector announces each stored chunk on its own, with its parent,
as its copy completes (``self-describing`` events, whose order it leaves free), so a block may arrive before the block
it continues. A tier block whose parent its index does not hold yet waits for it (up to ``MAX_WAITING_BLOCKS`` per
medium; past that the oldest is applied as it is, an orphan its index counts); a removal of a waiting block drops it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from p2pnode.cache.block_hash import iter_block_hashes
from p2pnode.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, CacheReset
from p2pnode.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cache.tiers import Medium, TierDepths

__all__ = ["MAX_WAITING_BLOCKS", "TierIndexes"]

#: Tier blocks held, per medium, until the block they continue arrives (module docstring).
MAX_WAITING_BLOCKS = 4096


class TierIndexes:
    """The engine's index and its tiers' (module docstring). Not thread-safe, as ``PrefixIndex``."""

    def __init__(self, gpu: PrefixIndex, host: PrefixIndex | None = None, disk: PrefixIndex | None = None) -> None:
        self.gpu = gpu
        self.host = host
        self.disk = disk
        self.block_size = gpu.block_size
        for index in (host, disk):
            if index is not None and index.block_size != gpu.block_size:
                raise ValueError("every medium's index must use the engine's block size")
        # per tier medium: the parent's engine hash -> the events waiting for it, oldest parent first
        self._waiting: dict[Medium, OrderedDict[int, list[BlockStored]]] = {
            Medium.HOST: OrderedDict(),
            Medium.DISK: OrderedDict(),
        }
        self._waiting_count = {Medium.HOST: 0, Medium.DISK: 0}
        # per tier medium: each waiting block's engine hash -> the parent its event waits for (a removal then reads
        # only the lists it touches, not every waiting event: ~5 ms a removal at the bound before)
        self._waiting_at: dict[Medium, dict[int, int]] = {Medium.HOST: {}, Medium.DISK: {}}

    @classmethod
    def for_engine(cls, gpu: PrefixIndex, host_tier: bool, disk_tier: bool = False) -> TierIndexes:
        """The indexes of an engine with the tiers named (each as large as the engine's own, by default)."""
        size = gpu.block_size, gpu.max_blocks, gpu.max_journal
        return cls(gpu, PrefixIndex(*size) if host_tier else None, PrefixIndex(*size) if disk_tier else None)

    def of(self, medium: Medium) -> PrefixIndex | None:
        """The index of ``medium`` (None: the engine has no such tier)."""
        return {Medium.GPU: self.gpu, Medium.HOST: self.host, Medium.DISK: self.disk}[medium]

    def below(self) -> dict[Medium, PrefixIndex]:
        """The indexes of the tiers below the engine it has (each published as a summary of its own)."""
        return {m: index for m, index in ((Medium.HOST, self.host), (Medium.DISK, self.disk)) if index is not None}

    @property
    def has_tiers(self) -> bool:
        return self.host is not None or self.disk is not None

    def apply(self, event: CacheEvent) -> None:
        """Apply one engine event to the index of its medium (a clear of the engine's cache to the engine's index
        only; a reset -- the engine restarted, or events were lost -- to all)."""
        if isinstance(event, BlockStored | BlockRemoved):
            index = self.of(event.medium)
            if index is None:
                return
            if event.medium is Medium.GPU:
                index.apply(event)
            elif isinstance(event, BlockStored):
                self._store_in_tier(index, event)
            else:
                self._drop_waiting(event)
                index.apply(event)
        elif isinstance(event, AllBlocksCleared):
            self.gpu.apply(event)
        elif isinstance(event, CacheReset):
            for index in (self.gpu, self.host, self.disk):
                if index is not None:
                    index.apply(event)
            for waiting in self._waiting.values():
                waiting.clear()
            for waiting_at in self._waiting_at.values():
                waiting_at.clear()
            self._waiting_count = dict.fromkeys(self._waiting_count, 0)
        else:
            raise TypeError(f"not a cache event: {event!r}")

    def waiting_blocks(self, medium: Medium) -> int:
        """Tier blocks held until the block they continue arrives (module docstring)."""
        return self._waiting_count[medium]

    def _store_in_tier(self, index: PrefixIndex, event: BlockStored) -> None:
        """Apply a tier's stored blocks once their parent is in ``index``, then whatever waited for them."""
        medium = event.medium
        waiting, waiting_at = self._waiting[medium], self._waiting_at[medium]
        parent = event.parent_engine_hash
        if parent is not None and not index.has_engine_block(parent):
            waiting.setdefault(parent, []).append(event)
            waiting_at.update(dict.fromkeys(event.engine_block_hashes, parent))
            self._waiting_count[medium] += _blocks([event])
            while self._waiting_count[medium] > MAX_WAITING_BLOCKS:
                oldest_parent, oldest = waiting.popitem(last=False)
                self._forget_waiting(medium, oldest_parent, oldest)
                for stale in oldest:
                    index.apply(stale)  # counted as an orphan by the index
            return
        ready = [event]
        while ready:
            stored = ready.pop()
            index.apply(stored)
            if waiting:
                for engine_hash in stored.engine_block_hashes:
                    children = waiting.pop(engine_hash, None)
                    if children:
                        self._forget_waiting(medium, engine_hash, children)
                        ready.extend(children)

    def _forget_waiting(self, medium: Medium, parent: int, events: list[BlockStored]) -> None:
        """``events``, waiting for ``parent``, no longer wait (taken out of ``_waiting`` by the caller)."""
        self._waiting_count[medium] -= _blocks(events)
        waiting_at = self._waiting_at[medium]
        for e in events:
            for engine_hash in e.engine_block_hashes:
                if waiting_at.get(engine_hash) == parent:
                    del waiting_at[engine_hash]

    def _drop_waiting(self, event: BlockRemoved) -> None:
        """A tier dropped blocks that may still be waiting for their parent: they never enter its index."""
        medium = event.medium
        waiting, waiting_at = self._waiting[medium], self._waiting_at[medium]
        if not waiting:
            return
        gone = set(event.engine_block_hashes)
        for parent in {waiting_at[h] for h in gone if h in waiting_at}:
            events = waiting.get(parent)
            if not events:
                continue
            dropped = [e for e in events if not gone.isdisjoint(e.engine_block_hashes)]
            kept = [e for e in events if gone.isdisjoint(e.engine_block_hashes)]
            self._forget_waiting(medium, parent, dropped)
            if kept:
                waiting[parent] = kept
            else:
                del waiting[parent]

    def match_tiers(
        self, token_ids: Sequence[int] | np.ndarray, namespace: CacheNamespace = DEFAULT_NAMESPACE
    ) -> TierDepths:
        """How deep ``token_ids``' prefix (in ``namespace``) reaches on this node, in blocks, as vLLM would reuse it
        (module docstring); capped, as ``PrefixIndex.match``, at the prompt's full blocks but its last token."""
        max_blocks = (len(token_ids) - 1) // self.block_size if len(token_ids) else 0
        if max_blocks <= 0:
            return TierDepths()
        return self.depths(list(iter_block_hashes(token_ids, self.block_size, namespace.root, max_blocks=max_blocks)))

    def depths(self, hashes: Sequence[int], gpu: int | None = None) -> TierDepths:
        """The depths of a prompt's block hashes (already capped as the caller wants) whose first ``gpu`` blocks the
        engine holds (None: read from the engine's index): what the router asks of its own node."""
        if gpu is None:
            gpu = self.gpu.match_blocks(hashes)
        host_index, disk_index = self.host, self.disk
        host = gpu
        if host_index is not None:
            while host < len(hashes) and hashes[host] in host_index:
                host += 1
        disk = host
        if disk_index is not None:  # the disk tier's run may go on through blocks the host tier holds too
            below = (disk_index,) if host_index is None else (disk_index, host_index)
            while disk < len(hashes) and any(hashes[disk] in index for index in below):
                disk += 1
        return TierDepths(gpu, host, disk)


def _blocks(events: Sequence[BlockStored]) -> int:
    return sum(len(e.engine_block_hashes) for e in events)
