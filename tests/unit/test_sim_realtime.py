"""The simulated engine serving for real (``engine/simulated/realtime.py``): the simulator's batching engine on the
node's event loop -- tokens stream as steps complete, requests queue when the batch is full, an abort ends a request
at a step boundary, and the KV events keep a real PrefixIndex exactly in step with the engine's cache."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from p2pnode.cache.events import CacheEvent
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.engine.base import FinishReason, SamplingOptions
from p2pnode.engine.simulated.cost import fixed_step_profile
from p2pnode.engine.simulated.realtime import SimEngine

BS = 32


async def started(**kw: object) -> tuple[SimEngine, PrefixIndex]:
    engine = SimEngine(block_size=BS, **kw)  # type: ignore[arg-type]
    index = PrefixIndex(block_size=BS)

    def sink(events: list[CacheEvent]) -> None:
        for e in events:
            index.apply(e)

    await engine.start(sink)
    return engine, index


def opts(max_tokens: int) -> SamplingOptions:
    return SamplingOptions(max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=0)


async def test_tokens_stream_one_step_at_a_time_and_the_repeat_hits_the_cache() -> None:
    engine, index = await started(token_delay_s=0.002, num_blocks=64)
    prompt = list(range(10, 10 + 3 * BS + 5))
    chunks = [c async for c in engine.generate("a", prompt, opts(6))]
    assert sum(len(c.token_ids) for c in chunks) == 6
    assert len(chunks) >= 3  # not one burst at the end: the client sees tokens as steps complete
    assert chunks[-1].finish_reason is FinishReason.LENGTH and chunks[0].cached_tokens == 0
    again = [c async for c in engine.generate("b", prompt, opts(2))]
    assert again[0].cached_tokens == 3 * BS == index.match(prompt)
    assert [t for c in again for t in c.token_ids] == [t for c in chunks for t in c.token_ids][:2]  # deterministic


async def test_a_full_batch_queues_and_the_load_says_so() -> None:
    profile = replace(fixed_step_profile(0.02), max_num_seqs=2)  # 20 steps of 20 ms: 0.4 s per request
    engine, _ = await started(profile=profile, num_blocks=256)

    async def run(i: int) -> int:
        return sum([len(c.token_ids) async for c in engine.generate(f"r{i}", [5 + i] * 40, opts(20))])

    tasks = [asyncio.create_task(run(i)) for i in range(5)]
    await asyncio.sleep(0.05)  # admissions happen at step boundaries: a few steps in, the batch is full
    status = engine.status()
    assert status.load.running == 2 and status.load.waiting == 3 and status.unfinished == 5
    assert await asyncio.gather(*tasks) == [20] * 5
    assert engine.status().unfinished == 0


async def test_closing_the_stream_aborts_at_a_step_and_keeps_the_index_exact() -> None:
    engine, index = await started(token_delay_s=0.001, num_blocks=24, max_model_len=24 * BS)
    prompt = list(range(20, 20 + 2 * BS))
    received: list[int] = []
    stream = engine.generate("long", prompt, opts(500))
    async for chunk in stream:
        received += chunk.token_ids
        if len(received) >= 40:
            break
    await stream.aclose()
    await asyncio.sleep(0.01)  # the next step boundary
    assert engine.status().unfinished == 0 and engine.status().load.running == 0
    cache = engine._engine.cache  # type: ignore[union-attr]
    assert cache.n_pinned == 0 and cache.free + len(cache.refs) == cache.num_blocks
    assert set(cache.refs) == {h for h, _ in index.iter_blocks()}  # what the node's index holds is what is cached
    # The prompt's blocks and the full blocks of what it produced before the abort are cached, not its 500 tokens.
    seen = [*prompt, *received]
    assert index.match([*seen, 0]) == len(seen) // BS * BS >= 3 * BS
    assert len(cache.refs) < (len(prompt) + 500) // BS
    # Filling the cache with other prompts evicts through BlockRemoved events: still in step.
    for i in range(12):
        _ = [c async for c in engine.generate(f"f{i}", [100 + i] * (3 * BS), opts(1))]
    assert set(cache.refs) == {h for h, _ in index.iter_blocks()} and cache.evictions > 0


def test_a_kv_cache_smaller_than_one_request_is_refused_at_start() -> None:
    import pytest

    with pytest.raises(ValueError, match="max_model_len"):
        SimEngine(block_size=BS, num_blocks=16, max_model_len=1024)


async def test_an_abort_while_waiting_never_runs() -> None:
    profile = replace(fixed_step_profile(0.05), max_num_seqs=1)  # the first one runs for 0.5 s
    engine, _ = await started(profile=profile, num_blocks=64)
    first = asyncio.create_task(_drain(engine.generate("first", [7] * 40, opts(10))))
    await asyncio.sleep(0.001)
    waiting = engine.generate("queued", [8] * 40, opts(10))
    task = asyncio.create_task(_drain(waiting))
    await asyncio.sleep(0.002)
    assert engine.status().load.waiting == 1
    task.cancel()
    await asyncio.sleep(0.001)
    assert engine.status().load.waiting == 0
    assert await first == 10


async def _drain(stream: object) -> int:
    return sum([len(c.token_ids) async for c in stream])  # type: ignore[attr-defined]
