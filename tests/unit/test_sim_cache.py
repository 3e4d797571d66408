"""The simulator's block space, paged prefix cache and eviction policies."""

from __future__ import annotations

import random

import pytest

from p2pnode.cache.block_hash import block_hashes
from p2pnode.cache.eviction.s3fifo import S3FIFO
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.engine.simulated.kvcache import PagedPrefixCache
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.workloads.base import Stream

BS = 4


def test_block_space_hashes_like_the_node() -> None:
    space = BlockSpace(16)
    cids = [1, 2**40 + 7, 0, 2**64 - 1]
    chain: list[int] = []
    space.extend(chain, [], cids)
    assert chain == block_hashes(list(space.tokens(cids)), 16) == block_hashes(space.token_array(cids), 16)
    # A continuation hashes like the whole prefix.
    assert space.hashes(cids[2:], parent=chain[1]) == chain[2:]
    with pytest.raises(ValueError):
        space.extend([], [], [-1])


@pytest.mark.parametrize("n_blocks", [1, 16, 17, 40])
def test_token_array_is_the_tokens_at_every_length(n_blocks: int) -> None:
    """Few blocks are joined from bytes, many filled into a reused array: the same tokens either way."""
    space = BlockSpace(16)
    rng = random.Random(n_blocks)
    cids = [rng.getrandbits(64) for _ in range(n_blocks)]
    arr = space.token_array(cids)
    assert arr.dtype == "<u4" and arr.ndim == 1
    assert arr.tolist() == list(space.tokens(cids))


def _req(rid: int, cids: list[int], prompt: int, output: int, space: BlockSpace) -> SimRequest:
    """A request over ``cids``, padded with blocks of its own up to its prompt + output length."""
    need = (prompt + output) // space.block_size
    cids = cids + [10**9 + rid * 100 + i for i in range(len(cids), need)]
    chain: list[int] = []
    space.extend(chain, [], cids)
    return SimRequest(rid, 0.0, "k", prompt, output, chain, list(cids), space.block_size)


def _serve(cache: PagedPrefixCache, r: SimRequest) -> int:
    assert cache.admit(r)
    cache.store_prompt(r)
    cache.release(r)
    return r.cached_tokens


def _check(cache: PagedPrefixCache) -> None:
    assert set(cache.refs) == {h for h, _ in cache.index.iter_blocks()}
    assert cache.free + len(cache.refs) == cache.num_blocks  # nothing running
    assert cache.n_pinned == 0


def test_hits_respect_the_last_token_cap_and_cache_outputs() -> None:
    space = BlockSpace(BS)
    cache = PagedPrefixCache(64, space.block_size, "lru", space.block_tokens)
    a = _req(0, [1, 2, 3, 4], 12, 4, space)  # 3 prompt blocks + 1 output block
    assert _serve(cache, a) == 0
    again = _req(1, [1, 2, 3, 4], 12, 4, space)
    assert _serve(cache, again) == 8  # (12 - 1) // 4 = 2 blocks: the last prompt token is always computed
    longer = _req(2, [1, 2, 3, 4, 5], 17, 0, space)
    assert _serve(cache, longer) == 16  # includes the first request's cached output block
    _check(cache)


def test_capacity_accounting_and_index_mirror_under_pressure() -> None:
    space = BlockSpace(BS)
    cache = PagedPrefixCache(40, space.block_size, "lru", space.block_tokens)
    rng = random.Random(1)
    running: list[SimRequest] = []
    for rid in range(400):
        n = rng.randint(1, 6)
        cids = [rng.randint(0, 12) * 100 + i for i in range(n)]
        r = _req(rid, cids, n * BS + rng.randint(0, 3), rng.randint(1, 6), space)
        if cache.admit(r):
            running.append(r)
            anon = sum(x.anon_blocks for x in running)
            assert cache.free + len(cache.refs) + anon == cache.num_blocks
            cache.store_prompt(r)
        while running and (len(running) > 3 or rng.random() < 0.4):
            cache.release(running.pop(rng.randrange(len(running))))
        assert set(cache.refs) == {h for h, _ in cache.index.iter_blocks()}
        assert all(c >= 0 for c in cache.refs.values())
    for r in running:
        cache.release(r)
    _check(cache)
    assert cache.index.stats().orphaned_blocks == 0


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_a_cache_storing_by_hash_keeps_the_index_an_engines_events_would(policy: str) -> None:
    """The simulator's caches store into their own index by hash (``PrefixIndex.store_hashed``); a node's engine
    sends ``BlockStored`` events with the blocks' tokens, which the index hashes. Driven alike, the two indexes hold
    the same blocks at the same depths, in the same order, with the same journal and counters."""
    space = BlockSpace(BS)
    fed, mine = (PrefixIndex(BS, max_blocks=24, max_journal=4096) for _ in range(2))  # overflows, orphans after them
    by_hash = PagedPrefixCache(40, BS, policy, space.block_tokens, index=mine)
    by_events = PagedPrefixCache(40, BS, policy, space.block_tokens, emit=fed.apply)
    assert by_hash.owns_index and not by_events.owns_index
    rng = random.Random(3)
    running: list[tuple[SimRequest, SimRequest]] = []
    for rid in range(400):
        n = rng.randint(1, 6)
        cids = [rng.randint(0, 12) * 100 + i for i in range(n)]
        prompt, output = n * BS + rng.randint(0, 3), rng.randint(1, 6)
        a, b = _req(rid, cids, prompt, output, space), _req(rid, cids, prompt, output, space)
        assert by_hash.admit(a) == by_events.admit(b)
        if a.anon_blocks:
            by_hash.store_prompt(a)
            by_events.store_prompt(b)
            running.append((a, b))
        while running and (len(running) > 3 or rng.random() < 0.4):
            a, b = running.pop(rng.randrange(len(running)))
            by_hash.release(a)
            by_events.release(b)
        assert list(mine.iter_blocks()) == list(fed.iter_blocks())
        assert mine.changes_since(0) == fed.changes_since(0) and mine.stats() == fed.stats()
    stats = fed.stats()
    assert stats.stored_blocks_total > 500 and stats.overflow_evictions > 0 and stats.orphaned_blocks > 0


def test_pinned_blocks_are_never_evicted() -> None:
    space = BlockSpace(BS)
    for policy in ("lru", "s3fifo"):
        cache = PagedPrefixCache(8, space.block_size, policy, space.block_tokens)
        held = _req(0, [1, 2, 3], 12, 1, space)
        assert cache.admit(held)
        cache.store_prompt(held)
        pinned = set(held.chain[:3])
        for rid in range(1, 30):
            r = _req(rid, [1000 + rid, 2000 + rid], 8, 1, space)
            assert cache.admit(r), policy
            cache.store_prompt(r)
            cache.release(r)
            assert pinned <= set(cache.refs), policy
        big = _req(99, list(range(5000, 5008)), 32, 1, space)
        assert not cache.admit(big)  # 9 blocks never fit beside 4 pinned ones


def _hot_then_scan(policy: str) -> float:
    """Hit rate of a hot set of 8 prompts, re-read between bursts of a one-time scan."""
    space = BlockSpace(BS)
    cache = PagedPrefixCache(48, space.block_size, policy, space.block_tokens)
    hot = [[10 * k + i for i in range(4)] for k in range(8)]  # 8 prompts x 4 blocks = 32 blocks
    hits = total = 0
    rid = 0
    scan = 10_000
    for rnd in range(30):
        for cids in hot:
            r = _req(rid, cids, 17, 1, space)
            rid += 1
            c = _serve(cache, r)
            if rnd >= 2:
                hits += c
                total += 16
        for _ in range(6):  # a scan of never-repeated prompts, 24 blocks per burst
            r = _req(rid, [scan, scan + 1, scan + 2, scan + 3], 17, 1, space)
            scan += 4
            rid += 1
            _serve(cache, r)
    _check(cache)
    return hits / total


def test_s3fifo_survives_a_scan_that_flushes_lru() -> None:
    lru, s3 = _hot_then_scan("lru"), _hot_then_scan("s3fifo")
    assert lru < 0.1  # 32 hot + 24 scan blocks > 48: LRU evicts the hot set every round
    assert s3 > 0.9  # the hot set lives in the main queue; the scan passes through the small one


def test_lru_evicts_a_chains_tail_first() -> None:
    space = BlockSpace(BS)
    cache = PagedPrefixCache(5, space.block_size, "lru", space.block_tokens)
    a = _req(0, [1, 2, 3, 4], 17, 1, space)
    _serve(cache, a)
    b = _req(1, [9], 5, 1, space)  # needs 2 blocks: 1 free + 1 evicted
    assert cache.admit(b)
    assert a.chain[3] not in cache.refs and a.chain[:3] == [h for h in a.chain[:3] if h in cache.refs]


def test_stream_turns_share_history() -> None:
    space = BlockSpace(BS)
    s = Stream(space, 7)
    r1 = s.request(0, 0.0, "k", 10, 6, "chat")
    r2 = s.request(1, 1.0, "k", 3, 2, "chat")
    assert r2.prompt_tokens == 19 and r2.chain is r1.chain
    assert r1.n_blocks == 4 and r2.n_prompt_blocks == 4


def test_s3fifo_finds_a_victim_when_main_is_all_pinned() -> None:
    refs: dict[int, int] = {h: 1 for h in range(20)}  # pinned by running requests
    pol = S3FIFO(100, refs)  # small-queue target: 10 blocks
    pol._main.update(dict.fromkeys(refs))  # the main queue holds only pinned blocks
    pol._freq.update(dict.fromkeys(refs, 0))
    refs[500] = 0
    pol.inserted([500])  # the only evictable block, alone in a small queue far below its target
    assert pol.victim() == 500
    assert list(pol._parked) == list(range(20)) and not pol._main and len(pol) == 20  # met once, set aside
    for h in range(20):
        refs[h] = 0
    pol.unpinned(list(range(20)))  # released: back in main, in release order
    assert list(pol._main) == list(range(20)) and not pol._parked


def test_s3fifo_meets_each_pinned_block_once_per_pin() -> None:
    """Under load most blocks are pinned: victim() reinserted each pinned one it met at main's tail and began its
    walk again on the next call -- every eviction walked the whole main queue (~4 ms a block at 20k blocks)."""
    refs: dict[int, int] = {h: 1 for h in range(2000)}
    pol = S3FIFO(2200, refs)
    pol.inserted(list(range(2000)))
    for h in range(2000, 2200):  # evictable blocks behind them
        refs[h] = 0
        pol.inserted([h])
    checks = 0
    real = refs.__getitem__

    class Counting(dict):  # type: ignore[type-arg]
        def __getitem__(self, h: int) -> int:
            nonlocal checks
            checks += 1
            return real(h)

    pol._refs = Counting(refs)
    victims = [pol.victim() for _ in range(200)]
    assert sorted(victims) == list(range(2000, 2200))
    assert checks <= 2 * 2200  # each block looked at a bounded number of times, not once per victim
