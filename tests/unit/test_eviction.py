"""Eviction policies (LRU, S3-FIFO, SIEVE, ARC), Belady's MIN, the replay cache, the selector and ``adaptive``."""

from __future__ import annotations

import itertools
import random

import pytest

from p2pnode.cache.eviction import EVICTION_POLICIES, get_eviction
from p2pnode.cache.eviction.belady import belady_hits
from p2pnode.cache.eviction.registry import STATIC_POLICIES, get_static
from p2pnode.cache.eviction.replay import Access, ReplayCache, hit_rate
from p2pnode.cache.eviction.selector import PolicySelector
from p2pnode.cache.eviction.switchable import Switchable
from p2pnode.config import EVICTION_CANDIDATES, EVICTION_POLICY_NAMES, EvictionConfig
from p2pnode.engine.simulated.kvcache import PagedPrefixCache
from p2pnode.sim.blocks import BlockSpace
from tests.unit.test_sim_cache import _check, _req, _serve

STATIC = sorted(STATIC_POLICIES)


def _chain(root: int, n: int) -> tuple[int, ...]:
    """A prefix chain: block i's id names the whole prefix (as chained hashes do)."""
    return tuple(root * 1000 + i for i in range(n))


def _replay(trace: list[Access], capacity: int, policy: str) -> list[int]:
    cache = ReplayCache(capacity, get_eviction(policy))
    observe = getattr(cache.policy, "observe", None)
    hits = []
    for a in trace:
        hits.append(cache.request(a.blocks, a.lookup))
        assert len(cache.refs) <= capacity
        if observe is not None:
            observe(a.blocks, a.lookup, a.prompt_blocks)
    return hits


def _random_trace(rng: random.Random, n: int, roots: int, depth: int) -> list[Access]:
    trace = []
    for _ in range(n):
        blocks = _chain(rng.randrange(roots), rng.randint(1, depth))
        lookup = rng.randint(0, len(blocks))
        trace.append(Access(blocks, lookup, lookup + 0.5))
    return trace


# --- the policies -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", STATIC)
def test_every_policy_keeps_pinned_blocks_and_the_index_exact(policy: str) -> None:
    space = BlockSpace(4)
    cache = PagedPrefixCache(40, space.block_size, policy, space.block_tokens)
    rng = random.Random(3)
    running = []
    for rid in range(500):
        n = rng.randint(1, 6)
        r = _req(
            rid, [rng.randint(0, 12) * 100 + i for i in range(n)], n * 4 + rng.randint(0, 3), rng.randint(1, 6), space
        )
        if cache.admit(r):
            running.append(r)
            cache.store_prompt(r)
        while running and (len(running) > 3 or rng.random() < 0.4):
            cache.release(running.pop(rng.randrange(len(running))))
        pinned = {h for x in running for h in x.chain[: x.cached_tokens // 4]}
        assert pinned <= set(cache.refs)
    for r in running:
        cache.release(r)
    _check(cache)


def _hot_twice_then_scan(policy: str) -> float:
    """Hit rate of 8 hot prompts, each read twice in a row, between bursts of a one-time scan."""
    space = BlockSpace(4)
    cache = PagedPrefixCache(48, space.block_size, policy, space.block_tokens)
    hot = [[10 * k + i for i in range(4)] for k in range(8)]  # 32 blocks
    hits = total = rid = 0
    scan = 10_000
    for rnd in range(30):
        for cids in (c for c in hot for _ in range(2)):
            c = _serve(cache, _req(rid, cids, 17, 1, space))
            rid += 1
            if rnd >= 2:
                hits += c
                total += 16
        for _ in range(6):  # 24 blocks of prompts never seen again
            _serve(cache, _req(rid, [scan + i for i in range(4)], 17, 1, space))
            scan += 4
            rid += 1
    _check(cache)
    return hits / total


@pytest.mark.parametrize("policy", ["s3fifo", "sieve", "arc"])
def test_frequency_aware_policies_keep_a_hot_set_through_a_scan_that_flushes_lru(policy: str) -> None:
    assert _hot_twice_then_scan("lru") == 0.5  # only each prompt's second read hits
    assert _hot_twice_then_scan(policy) > 0.95


def _recency_stream(n: int, seed: int = 1) -> list[Access]:
    """Conversations that grow a block per turn; the next turn is more likely the more recently a conversation was
    active (LRU's stack model: the rank of the returning one is geometric), 20% are new: the recency regime."""
    rng = random.Random(seed)
    threads: list[tuple[int, int]] = []  # (root, length), most recent first
    trace = []
    for root in itertools.count():
        if len(trace) == n:
            return trace
        rank = 0
        while rng.random() > 0.3:
            rank += 1
        if rng.random() < 0.2 or rank >= len(threads):
            length = 2
        else:
            root, length = threads.pop(rank)
            length += 1
        threads.insert(0, (root, length))
        trace.append(Access(_chain(root, length), length - 1, length - 0.5))
    return trace


def test_lru_wins_when_reuse_follows_recency() -> None:
    trace = _recency_stream(3000)
    rates = {p: hit_rate(trace, _replay(trace, 40, p), 1000) for p in STATIC}
    assert max(rates, key=lambda p: rates[p]) == "lru"
    assert rates["lru"] > rates["s3fifo"] + 0.1


@pytest.mark.parametrize("policy", STATIC)
def test_removed_blocks_are_never_victims(policy: str) -> None:
    refs: dict[int, int] = {}
    p = get_static(policy)(20, refs)
    for h in range(10):
        refs[h] = 1
    p.inserted(list(range(10)))
    p.accessed([1, 2, 3])
    for h in range(10):
        refs[h] = 0
    p.unpinned(list(range(9, -1, -1)))
    p.removed([0, 5, 9])
    for h in (0, 5, 9):
        del refs[h]
    seen = []
    for _ in range(7):
        h = p.victim()
        seen.append(h)
        del refs[h]
    assert sorted(seen) == [1, 2, 3, 4, 6, 7, 8]


# --- Belady ---------------------------------------------------------------------------------------------------------


def _optimum(trace: list[Access], capacity: int) -> int:
    """Exhaustive search over every eviction choice (tiny traces only): the most prefix-hit blocks."""
    best = 0

    def go(i: int, cache: frozenset[int], total: int) -> None:
        nonlocal best
        if i == len(trace):
            best = max(best, total)
            return
        a = trace[i]
        blocks = a.blocks[:capacity]
        m = 0
        while m < min(a.lookup, len(blocks)) and blocks[m] in cache:
            m += 1
        missing = [h for h in blocks if h not in cache]
        over = len(cache) + len(missing) - capacity
        evictable = sorted(cache - set(blocks))
        for gone in itertools.combinations(evictable, max(0, over)):
            go(i + 1, (cache - set(gone)) | set(blocks), total + m)

    go(0, frozenset(), 0)
    return best


def test_belady_is_the_optimum_on_small_traces() -> None:
    rng = random.Random(7)
    for _ in range(60):
        trace = _random_trace(rng, 7, 3, 3)
        cap = rng.randint(2, 4)
        assert sum(belady_hits(trace, cap)) == _optimum(trace, cap)


def test_no_policy_beats_belady() -> None:
    rng = random.Random(11)
    for _ in range(20):
        trace = _random_trace(rng, 300, 12, 8)
        cap = rng.randint(8, 40)
        best = sum(belady_hits(trace, cap))
        for policy in EVICTION_POLICIES:
            assert sum(_replay(trace, cap, policy)) <= best, policy


# --- the replay cache -----------------------------------------------------------------------------------------------


def test_replay_hits_are_prefix_hits_within_the_lookup_limit() -> None:
    cache = ReplayCache(10, get_static("lru"))
    assert cache.request(_chain(1, 4), 3) == 0
    assert cache.request(_chain(1, 4), 3) == 3  # the lookup limit (vLLM's last-token rule), not the 4 cached
    assert cache.request(_chain(1, 6), 6) == 4
    assert cache.request(_chain(2, 30), 30) == 0 and len(cache.refs) == 10  # longer than the cache: its first 10


# --- switching and the selector -------------------------------------------------------------------------------------


def test_a_switch_changes_the_next_victim_and_keeps_every_order_warm() -> None:
    refs: dict[int, int] = {}
    sw = Switchable(8, refs, {n: get_static(n) for n in ("lru", "s3fifo")}, "lru")
    cache = ReplayCache.__new__(ReplayCache)  # a replay cache around this very policy
    cache.capacity, cache.refs, cache.policy, cache.evictions = 8, refs, sw, 0
    hot = _chain(1, 2)
    for _ in range(3):
        cache.request(hot, 2)  # read three times: S3-FIFO would promote it
    for k in range(2, 5):
        cache.request(_chain(k, 2), 2)  # 8 blocks: the cache is full
    assert sw.switch("s3fifo") and not sw.switch("s3fifo")
    cache.request(_chain(9, 2), 2)  # S3-FIFO evicts from its small queue: not the hot chain
    assert set(hot) <= set(refs)
    sw.switch("lru")
    cache.request(hot, 2)  # LRU's order is intact: the hot chain was read; the oldest scans go first
    assert cache.request(hot, 2) == 2 and sw.switches == 2


def _scan_stream(n: int, seed: int = 1) -> list[Access]:
    """A hot set re-read between bursts of one-time prompts: the frequency regime."""
    rng = random.Random(seed)
    trace, scan = [], 10_000
    for _ in range(n):
        if rng.random() < 0.5:
            trace.append(Access(_chain(rng.randrange(8), 4), 4, 4.5))
        else:
            scan += 1
            trace.append(Access(_chain(scan, 4), 4, 4.5))
    return trace


def _selector_run(trace: list[Access], capacity: int, cfg: EvictionConfig) -> tuple[PolicySelector, list[str]]:
    sel = PolicySelector(capacity, cfg)
    choices = []
    for a in trace:
        c = sel.observe(a.blocks, a.lookup, a.prompt_blocks)
        if c is not None:
            choices.append(c)
    return sel, choices


def test_selector_leaves_lru_for_a_frequency_policy_on_scans_and_stays_put() -> None:
    sel, choices = _selector_run(_scan_stream(3000), 40, EvictionConfig(policy="adaptive"))
    assert sel.active != "lru" and len(choices) == 1  # one switch, no flapping afterwards
    rates = sel.hit_rates()
    assert rates[sel.active] > rates["lru"] + 0.2


def test_selector_keeps_lru_on_recency_traffic() -> None:
    sel, choices = _selector_run(_recency_stream(3000), 40, EvictionConfig(policy="adaptive"))
    assert sel.active == "lru" and choices == []
    assert sel.observed == sel.sampled == 3000


def test_selector_hysteresis_needs_the_margin() -> None:
    cfg = EvictionConfig(policy="adaptive", margin=1.0)  # nothing beats LRU by 100 points
    sel, choices = _selector_run(_scan_stream(2000), 40, cfg)
    assert choices == [] and sel.active == "lru"


def test_every_static_policy_runs_alone_but_adaptive_chooses_among_its_candidates_only() -> None:
    assert set(EVICTION_POLICY_NAMES) == set(STATIC_POLICIES)  # the CLI's choices are the policies that exist
    for name in EVICTION_POLICY_NAMES:  # a static policy need not be an adaptive candidate
        assert EvictionConfig(policy=name).policy == name
    sel = PolicySelector(40, EvictionConfig(policy="adaptive"))
    assert set(sel.shadows) == set(EVICTION_CANDIDATES) and sel.active == EVICTION_CANDIDATES[0]
    with pytest.raises(ValueError, match="'fifo'"):
        EvictionConfig(policy="fifo")
    with pytest.raises(ValueError, match="candidates \\['mru'\\]"):
        EvictionConfig(policy="adaptive", candidates=("lru", "mru"))


def test_selector_samples_by_first_block_above_its_memory_bound() -> None:
    cfg = EvictionConfig(policy="adaptive", shadow_max_blocks=100)
    sel = PolicySelector(1000, cfg)
    assert sel.sample_rate == pytest.approx(0.1) and sel.shadow_blocks == 100
    for a in _scan_stream(5000):
        sel.observe(a.blocks, a.lookup, a.prompt_blocks)
    assert 0.05 < sel.sampled / sel.observed < 0.2
    assert all(len(s.refs) <= 100 for s in sel.shadows.values())


def test_adaptive_in_the_simulated_cache_switches_and_keeps_the_index_exact() -> None:
    def run(policy: str) -> tuple[float, PagedPrefixCache]:
        """Hot prompts and one-time prompts at random, half and half: the hot prompts' hit rate."""
        space = BlockSpace(4)
        cache = PagedPrefixCache(48, space.block_size, policy, space.block_tokens)
        rng = random.Random(5)
        scan = 10_000
        hits = total = 0
        for rid in range(2000):
            if rng.random() < 0.5:
                cids = [10 * rng.randrange(8) + i for i in range(4)]
            else:
                cids = [scan + i for i in range(4)]
                scan += 4
            c = _serve(cache, _req(rid, cids, 17, 1, space))
            if rid >= 1000 and cids[0] < 10_000:
                hits += c
                total += 16
        _check(cache)
        return hits / total, cache

    static = {p: run(p)[0] for p in STATIC}
    adaptive, cache = run("adaptive")
    assert cache.policy.active_name != "lru" and cache.policy.switches >= 1  # type: ignore[attr-defined]
    assert adaptive >= max(static.values()) - 0.02 and adaptive > static["lru"] + 0.15
