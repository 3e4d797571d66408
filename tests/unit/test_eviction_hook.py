"""The engine core's free-block queue (``engine/eviction_hook.py``) against vLLM's own, driven like BlockPool drives it.

The real engine is exercised in tests/integration/test_eviction_engine.py; here both queues see the same random
allocations, cache hits, frees and evictions, so every block the two hand out can be compared.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from p2pnode.engine.eviction_hook import PolicyFreeBlockQueue

kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
KVCacheBlock = kv_cache_utils.KVCacheBlock
FreeKVCacheBlockQueue = kv_cache_utils.FreeKVCacheBlockQueue


class Pool:
    """BlockPool's use of its queue, reduced to what the queue sees (allocate, hash, touch, free)."""

    def __init__(self, n: int, ours: bool, active: str = "lru") -> None:
        self.blocks = [KVCacheBlock(i) for i in range(n)]
        vllm_queue = FreeKVCacheBlockQueue(self.blocks)
        null = vllm_queue.popleft()  # BlockPool's null block
        assert null.block_id == 0
        self.q: Any = PolicyFreeBlockQueue(vllm_queue.get_all_free_blocks(), n - 1, active) if ours else vllm_queue
        #: hash -> its cached physical copies (vLLM keeps a second copy when a chain is recomputed behind an
        #: evicted block, as S3-FIFO makes happen: the queue must track both).
        self.by_hash: dict[bytes, list[KVCacheBlock]] = {}

    def allocate(self, n: int) -> list[int]:
        out = self.q.popleft_n(n)
        for b in out:
            assert b.ref_cnt == 0
            if b.block_hash is not None:  # eviction: BlockPool drops the hash (and emits BlockRemoved)
                copies = self.by_hash[b.block_hash]
                copies.remove(b)
                if not copies:
                    del self.by_hash[b.block_hash]
                b.reset_hash()
            b.ref_cnt = 1
        return [b.block_id for b in out]

    def cache(self, ids: list[int], hashes: list[bytes]) -> None:
        for i, h in zip(ids, hashes, strict=True):
            b = self.blocks[i]
            b.set_block_hash(h)
            self.by_hash.setdefault(h, []).append(b)
        if isinstance(self.q, PolicyFreeBlockQueue):
            self.q.cached([self.blocks[i] for i in ids])

    def touch(self, hashes: list[bytes]) -> list[int]:
        hit = []
        for h in hashes:
            copies = self.by_hash.get(h)
            if not copies:
                break
            hit.append(copies[0])
        if isinstance(self.q, PolicyFreeBlockQueue):
            self.q.touched(hit)
        for b in hit:
            if b.ref_cnt == 0:
                self.q.remove(b)
            b.ref_cnt += 1
        return [b.block_id for b in hit]

    def free(self, ids: list[int]) -> None:
        first, last = [], []
        for i in reversed(ids):  # a request's blocks, tail first (vLLM's free order)
            b = self.blocks[i]
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                (first if b.block_hash is None else last).append(b)
        self.q.prepend_n(first)
        self.q.append_n(last)

    def check(self) -> None:
        free = [b for b in self.blocks[1:] if b.ref_cnt == 0]
        assert self.q.num_free_blocks == len(free)
        assert sorted(b.block_id for b in self.q.get_all_free_blocks()) == sorted(b.block_id for b in free)


def _drive(pools: list[Pool], seed: int, steps: int, switch: list[str] | None = None) -> None:
    """Requests of shared prefixes (so hits happen), several running at once; identical on every pool."""
    rng = random.Random(seed)
    running: list[list[list[int]]] = []  # per request, per pool: its block ids
    for step in range(steps):
        if switch and step % 37 == 0:
            for p in pools:
                p.q.policy.switch(rng.choice(switch))
        root = rng.randrange(12)
        n = rng.randint(1, 6)
        hashes = [f"{root}/{i}".encode() for i in range(n)]
        hits = [p.touch(hashes) for p in pools]
        m = len(hits[0])
        assert all(len(h) == m for h in hits)
        need = n - m + 1  # the rest of the prompt and a block for the output
        if need > pools[0].q.num_free_blocks:
            for p, h in zip(pools, hits, strict=True):
                p.free(h)
        else:
            ids = [h + p.allocate(need) for p, h in zip(pools, hits, strict=True)]
            assert len({tuple(i) for i in ids}) == 1 or switch, "LRU must hand out vLLM's blocks"
            for p, i in zip(pools, ids, strict=True):
                p.cache(i[m:n], hashes[m:])
            running.append(ids)
        while running and (len(running) > 4 or rng.random() < 0.5):
            done = running.pop(rng.randrange(len(running)))
            for p, i in zip(pools, done, strict=True):
                p.free(i)
        for p in pools:
            p.check()


def test_lru_hands_out_exactly_vllms_blocks() -> None:
    for seed in range(5):
        _drive([Pool(40, ours=False), Pool(40, ours=True)], seed, 600)


@pytest.mark.parametrize("active", ["s3fifo", "sieve", "arc"])
def test_every_policy_keeps_the_queue_exact(active: str) -> None:
    _drive([Pool(40, ours=True, active=active)], 3, 600)


def test_switching_at_any_time_keeps_the_queue_exact() -> None:
    pool = Pool(40, ours=True)
    _drive([pool], 4, 1500, switch=["lru", "s3fifo", "sieve", "arc"])
    assert pool.q.policy.switches > 10 and pool.q.evictions > 100
    stats = pool.q.stats()
    assert stats["cached_hashes"] == len(pool.by_hash)
    assert stats["cached_blocks"] == sum(len(c) for c in pool.by_hash.values())


def test_remove_of_a_block_that_is_not_free_fails_like_vllms() -> None:
    pool = Pool(8, ours=True)
    (i,) = pool.allocate(1)
    with pytest.raises(RuntimeError):
        pool.q.remove(pool.blocks[i])
