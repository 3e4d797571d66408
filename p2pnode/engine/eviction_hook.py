"""Inside vLLM's engine core: the free-block queue ordered by p2pnode's eviction policies, switchable at run time.

vLLM 0.32's ``BlockPool`` keeps every block with ``ref_cnt == 0`` in ``free_block_queue`` and allocates from its
head; for a cached block, being allocated *is* its eviction (``get_new_blocks`` -> ``_maybe_evict_cached_block``,
which drops the hash and queues ``BlockRemoved``). vLLM's queue is LRU: freed cached blocks go to the tail, a hit
takes the block out, blocks without a hash are put in front. ``PolicyFreeBlockQueue`` has the same methods and
keeps the same three kinds of free blocks, but orders the cached ones with a ``Switchable`` over p2pnode's
policies (``p2pnode/cache/eviction/``): hashless blocks first (as vLLM), then the active policy's victims, then
hashless blocks released with ``unpin_blocks`` (vLLM puts those at the tail). Its LRU gives exactly vLLM's order
(a test drives both with the same operations).

Where it runs: ``install()`` is called by ``lifeline.guarded_run_engine_core`` in the engine-core process, before
vLLM builds its scheduler, so every ``BlockPool`` with prefix caching gets the queue. The same process entry point
already exists for the lifeline, so no plugin package or entry point is needed (a ``vllm.general_plugins`` entry
point would load in every vLLM process of the host, including other users' engines). It also wraps three
``BlockPool`` methods so the policies see what the queue alone does not: ``cache_full_blocks`` (a block got a hash:
``inserted``), ``touch`` (a prefix hit, pinned or not: ``accessed``) and ``reset_prefix_cache`` (every hash dropped:
the policies start over).

Switching: ``EngineCore.p2pnode_eviction(command, arg)`` is added as a vLLM utility method; the node calls it
through ``AsyncLLM.engine_core.call_utility_async`` (``set`` a policy, or read ``stats``). vLLM runs utility calls
on the engine core's busy-loop thread between steps, so the queue is never changed concurrently.

KV events stay exact by construction: the queue only decides *which* free block ``popleft`` returns; vLLM still
evicts it and emits ``BlockRemoved`` itself. The queue's invariant (checked by the tests): every free block is in
exactly one of ``_plain``, ``_free`` (cached, known to the policies) and ``_last``; ``num_free_blocks`` is their
total; a block with ``ref_cnt > 0`` is never returned.

Keys: the policies see one int per cached physical block: the hash of its ``BlockHashWithGroupId`` (so S3-FIFO's
and ARC's ghosts recognise content that comes back), or, for a second physical copy of content already tracked
(vLLM does not de-duplicate), a key of its own above 2^64.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from p2pnode.cache.eviction.registry import get_static
from p2pnode.cache.eviction.switchable import Switchable
from p2pnode.config import EVICTION_POLICY_NAMES, VLLM_EVICTION_POLICY

log = logging.getLogger("p2pnode.engine")

__all__ = ["UTILITY_METHOD", "PolicyFreeBlockQueue", "install"]

#: Name of the utility method the node calls on the engine core.
UTILITY_METHOD = "p2pnode_eviction"
_DUP_BASE = 1 << 64

#: The engine core's queues (one per prefix-caching BlockPool; a plain decoder model has one).
_QUEUES: list[PolicyFreeBlockQueue] = []


class _Pins:
    """The policies' pin-count view of the queue: 0 for a free cached block, 1 for one held by a request."""

    __slots__ = ("_free",)

    def __init__(self, free: dict[int, Any]) -> None:
        self._free = free

    def __getitem__(self, key: int) -> int:
        return 0 if key in self._free else 1

    def get(self, key: int, default: int | None = None) -> int:
        return self[key]


class PolicyFreeBlockQueue:
    """vLLM's ``FreeKVCacheBlockQueue`` interface, cached blocks ordered by a switchable p2pnode policy."""

    def __init__(
        self,
        blocks: Sequence[Any],
        capacity: int,
        active: str = VLLM_EVICTION_POLICY,
        candidates: Sequence[str] = EVICTION_POLICY_NAMES,
    ) -> None:
        self._plain: OrderedDict[int, Any] = OrderedDict((b.block_id, b) for b in blocks)  # hashless: evicted first
        self._last: OrderedDict[int, Any] = OrderedDict()  # hashless, released by unpin_blocks: evicted last
        self._free: dict[int, Any] = {}  # key -> free cached block (evictable, known to the policies)
        self._key_of: dict[int, int] = {}  # block_id -> key, every cached block the policies know (pinned too)
        self._content_of: dict[int, int] = {}  # block_id -> hash of its block hash (== its key unless a copy)
        self._owner: dict[int, int] = {}  # key -> block_id (to spot a second physical copy of the same content)
        self._capacity, self._candidates = max(1, capacity), tuple(candidates)
        self.policy = Switchable(self._capacity, _Pins(self._free), {n: get_static(n) for n in candidates}, active)
        self.num_free_blocks = len(self._plain)
        self.evictions = 0

    def reset(self) -> None:
        """vLLM reset the prefix cache (every block free, every hash dropped): start over, same active policy."""
        blocks = [*self._plain.values(), *self._free.values(), *self._last.values()]
        evictions, switches = self.evictions, self.policy.switches
        self.__init__(blocks, self._capacity, self.policy.active_name, self._candidates)  # type: ignore[misc]
        self.evictions, self.policy.switches = evictions, switches

    # --- what the block pool tells the policies --------------------------------------------------------------

    def _register(self, block: Any) -> int:
        """The key of a cached block, telling the policies about it (pinned) the first time."""
        bid = block.block_id
        content = hash(block.block_hash)
        old = self._key_of.get(bid)
        if old is not None:
            if self._content_of[bid] == content:
                return old
            self._forget(bid)  # re-hashed while tracked (a partial block made full): a new block to the policies
        key = _DUP_BASE + bid if content in self._owner else content
        self._key_of[bid] = key
        self._content_of[bid] = content
        self._owner[key] = bid
        self.policy.inserted((key,))
        return key

    def _forget(self, bid: int) -> None:
        key = self._key_of.pop(bid)
        del self._content_of[bid]
        self._owner.pop(key, None)
        self._free.pop(key, None)
        self.policy.removed((key,))

    def cached(self, blocks: Sequence[Any]) -> None:
        """``cache_full_blocks`` gave these (held) blocks their hashes."""
        for b in blocks:
            if not b.is_null and b.block_hash is not None:
                self._register(b)

    def touched(self, blocks: Sequence[Any]) -> None:
        """``touch``: a request reuses these cached blocks (before vLLM takes the free ones out of the queue)."""
        keys = [self._register(b) for b in blocks if not b.is_null and b.block_hash is not None]
        if keys:
            self.policy.accessed(keys)

    # --- FreeKVCacheBlockQueue -----------------------------------------------------------------------------

    def popleft(self) -> Any:
        if self.num_free_blocks == 0:
            raise ValueError("No free blocks available")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[Any]:
        if n == 0:
            return []
        assert self.num_free_blocks >= n, f"asked for {n} of {self.num_free_blocks} free blocks"
        out: list[Any] = []
        plain = self._plain
        while plain and len(out) < n:
            out.append(plain.popitem(last=False)[1])
        free, victim = self._free, self.policy.victim
        while free and len(out) < n:
            key = victim()
            block = free.pop(key)
            del self._key_of[block.block_id]
            del self._content_of[block.block_id]
            self._owner.pop(key, None)
            out.append(block)
            self.evictions += 1
        last = self._last
        while last and len(out) < n:
            out.append(last.popitem(last=False)[1])
        self.num_free_blocks -= n
        return out

    def remove(self, block: Any) -> None:
        bid = block.block_id
        if self._plain.pop(bid, None) is None and self._last.pop(bid, None) is None:
            key = self._key_of.get(bid)
            if key is None or self._free.pop(key, None) is None:
                raise RuntimeError(f"remove() called on a block that is not free: {block}")
            self.policy.pinned((key,))
        self.num_free_blocks -= 1

    def append(self, block: Any) -> None:
        self.append_n([block])

    def append_n(self, blocks: Sequence[Any]) -> None:
        released: list[int] = []
        for b in blocks:
            if b.block_hash is None:
                if b.block_id in self._key_of:  # lost its hash while held (a KV connector evicted it)
                    self._forget(b.block_id)
                self._last[b.block_id] = b
                continue
            key = self._register(b)
            self._free[key] = b
            released.append(key)
        if released:
            self.policy.unpinned(released)
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[Any]) -> None:
        plain = self._plain
        for b in reversed(blocks):
            if b.block_id in self._key_of:
                self._forget(b.block_id)
            plain[b.block_id] = b
            plain.move_to_end(b.block_id, last=False)
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[Any]:
        """Every free block: hashless ones, then the cached ones (not in eviction order), then ``_last``."""
        return [*self._plain.values(), *self._free.values(), *self._last.values()]

    def iter_blocks_after(self, cursor: Any | None) -> Iterator[Any]:
        """Free blocks after ``cursor`` in ``get_all_free_blocks``'s order (vLLM's CPU offloading walks it)."""
        blocks = self.get_all_free_blocks()
        start = 0
        if cursor is not None:
            ids = [b.block_id for b in blocks]
            start = ids.index(cursor.block_id) + 1 if cursor.block_id in ids else 0
        yield from blocks[start:]

    # --- control -------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            "active": self.policy.active_name,
            "candidates": list(self.policy.policies),
            "switches": self.policy.switches,
            "evictions": self.evictions,
            "free_blocks": self.num_free_blocks,
            "cached_blocks": len(self._key_of),
            # Distinct contents among them (vLLM keeps a second physical copy of a block two requests computed at
            # once): what the node's prefix index should hold.
            "cached_hashes": len(set(self._content_of.values())),
        }


def _utility(engine_core: Any, command: str, arg: str = "") -> dict[str, Any]:
    """``set <policy>`` or ``stats``: the engine core's side of the node's control channel."""
    if command == "set":
        for q in _QUEUES:
            if q.policy.switch(arg):
                log.info("eviction policy is now %s", arg)
    elif command != "stats":
        raise ValueError(f"unknown eviction command {command!r}")
    if not _QUEUES:
        return {"installed": False}
    return {"installed": True, **_QUEUES[0].stats()}


def install(active: str = VLLM_EVICTION_POLICY) -> None:
    """Give every prefix-caching ``BlockPool`` built from now on a ``PolicyFreeBlockQueue`` (engine-core process)."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.engine.core import EngineCore

    if getattr(BlockPool, "_p2pnode_eviction", False):
        return
    original_init = BlockPool.__init__
    original_touch = BlockPool.touch
    original_cache_full_blocks = BlockPool.cache_full_blocks
    original_reset = BlockPool.reset_prefix_cache

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if self.enable_caching:
            q = PolicyFreeBlockQueue(self.free_block_queue.get_all_free_blocks(), self.num_gpu_blocks - 1, active)
            self.free_block_queue = q
            _QUEUES.append(q)

    def touch(self: Any, blocks: Sequence[Any]) -> None:
        q = self.free_block_queue
        if isinstance(q, PolicyFreeBlockQueue):
            q.touched(blocks)
        original_touch(self, blocks)

    def cache_full_blocks(
        self: Any,
        request: Any,
        blocks: list[Any],
        num_cached_blocks: int,
        num_full_blocks: int,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        original_cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs)
        q = self.free_block_queue
        if isinstance(q, PolicyFreeBlockQueue) and num_full_blocks > num_cached_blocks:
            q.cached(blocks[num_cached_blocks:num_full_blocks])

    def reset_prefix_cache(self: Any) -> bool:
        done = original_reset(self)
        q = self.free_block_queue
        if done and isinstance(q, PolicyFreeBlockQueue):
            q.reset()
        return bool(done)

    BlockPool.__init__ = __init__  # type: ignore[method-assign]
    BlockPool.reset_prefix_cache = reset_prefix_cache  # type: ignore[method-assign]
    BlockPool.touch = touch  # type: ignore[method-assign]
    BlockPool.cache_full_blocks = cache_full_blocks  # type: ignore[method-assign]
    BlockPool._p2pnode_eviction = True  # type: ignore[attr-defined]
    setattr(EngineCore, UTILITY_METHOD, _utility)
