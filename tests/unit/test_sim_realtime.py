"""The simulated engine serving for real (``engine/simulated/realtime.py``): the simulator's batching engine on the
node's event loop -- tokens stream as steps complete, requests queue when the batch is full, an abort ends a request
at a step boundary, and the KV events keep a real PrefixIndex exactly in step with the engine's cache.

The engine runs on a ``ManualClock``: a step ends only when the test moves the clock to it, so what the engine does
at each step boundary is checked exactly, however slowly the host runs the test."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from p2pnode.cache.events import CacheEvent
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cost import fixed_step_profile
from p2pnode.engine.base import FinishReason
from p2pnode.engine.simulated.realtime import SimEngine
from p2pnode.request import Request, SamplingOptions

BS = 32


class ManualClock:
    """The engine's clock (``batching.Scheduler``), moved by the test: ``next()`` jumps to the earliest scheduled
    step boundary, runs what is due there, then lets every task it woke run until they wait again."""

    def __init__(self) -> None:
        self.now = 0.0
        self._due: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._order = itertools.count()

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        heapq.heappush(self._due, (t, next(self._order), fn, arg))

    async def next(self) -> None:
        assert self._due, "nothing is scheduled: the engine is idle"
        t = self._due[0][0]
        self.now = max(self.now, t)
        while self._due and self._due[0][0] <= t:
            _, _, fn, arg = heapq.heappop(self._due)
            fn(arg)
        await settle()

    async def step(self) -> None:
        """Run the one earliest scheduled callback (of several due at the same time, only the first)."""
        assert self._due, "nothing is scheduled: the engine is idle"
        t, _, fn, arg = heapq.heappop(self._due)
        self.now = max(self.now, t)
        fn(arg)
        await settle()

    async def run_until(self, done: Callable[[], bool], limit: int = 10_000) -> None:
        """Step boundary after step boundary until ``done()``."""
        await settle()  # tasks just created submit their requests first
        for _ in range(limit):
            if done():
                return
            await self.next()
        raise AssertionError(f"not done after {limit} step boundaries")


async def settle() -> None:
    """Let every ready task run until it waits on something (a wake-up, the clock): a few loop iterations."""
    for _ in range(20):
        await asyncio.sleep(0)


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
    clock = ManualClock()
    engine, index = await started(token_delay_s=0.002, num_blocks=64, clock=clock)
    prompt = list(range(10, 10 + 3 * BS + 5))
    chunks = []

    async def read() -> None:
        async for c in engine.generate(Request("a", prompt, opts(6))):
            chunks.append(c)

    reader = asyncio.create_task(read())
    await settle()
    assert chunks == []  # nothing before the prefill step ends
    for step in range(1, 7):  # the prefill step gives the first token, each decode step one more
        await clock.next()
        assert sum(len(c.token_ids) for c in chunks) == step  # the client has it as soon as its step is done
    await reader
    assert chunks[-1].finish_reason is FinishReason.LENGTH and chunks[0].cached_tokens == 0
    again = []
    reader = asyncio.create_task(_collect(engine.generate(Request("b", prompt, opts(2))), again))
    await clock.run_until(reader.done)
    assert again[0].cached_tokens == 3 * BS == index.match(prompt)
    assert [t for c in again for t in c.token_ids] == [t for c in chunks for t in c.token_ids][:2]  # deterministic


async def test_a_full_batch_queues_and_the_load_says_so() -> None:
    clock = ManualClock()
    profile = replace(fixed_step_profile(0.02), max_num_seqs=2)  # 20 steps per request, two requests at a time
    engine, _ = await started(profile=profile, num_blocks=256, clock=clock)

    async def run(i: int) -> int:
        return sum([len(c.token_ids) async for c in engine.generate(Request(f"r{i}", [5 + i] * 40, opts(20)))])

    tasks = [asyncio.create_task(run(i)) for i in range(5)]
    await settle()
    status = engine.status()  # the first arrival started a step alone; the others wait for its boundary
    assert status.load.running == 1 and status.load.waiting == 4 and status.unfinished == 5
    await clock.next()  # admissions happen at step boundaries: the batch is full, three wait
    status = engine.status()
    assert status.load.running == 2 and status.load.waiting == 3 and status.unfinished == 5
    await clock.run_until(tasks[0].done)  # the first to finish frees a slot: the next in line takes it
    status = engine.status()
    assert status.load.running == 2 and status.load.waiting == 2 and status.unfinished == 4 and not tasks[1].done()
    await clock.run_until(lambda: all(t.done() for t in tasks))
    assert [t.result() for t in tasks] == [20] * 5
    assert engine.status().unfinished == 0


async def test_closing_the_stream_aborts_at_a_step_and_keeps_the_index_exact() -> None:
    clock = ManualClock()
    engine, index = await started(token_delay_s=0.001, num_blocks=24, max_model_len=24 * BS, clock=clock)
    prompt = list(range(20, 20 + 2 * BS))
    received: list[int] = []
    stream = engine.generate(Request("long", prompt, opts(500)))
    reader = asyncio.create_task(_collect_until(stream, received, 40))
    await clock.run_until(reader.done)
    await stream.aclose()
    await settle()
    assert engine.status().unfinished == 0  # gone for the node at once...
    assert engine.status().load.running == 1  # ...while the engine ends it at its next step boundary
    await clock.next()
    assert engine.status().load.running == 0
    cache = engine._engine.cache  # type: ignore[union-attr]
    assert cache.n_pinned == 0 and cache.free + len(cache.refs) == cache.num_blocks
    assert set(cache.refs) == {h for h, _ in index.iter_blocks()}  # what the node's index holds is what is cached
    # The prompt's blocks and the full blocks of what it produced before the abort are cached, not its 500 tokens.
    produced = len(received) + 1  # the step the abort waited for produced one more token, which nobody read
    seen = [*prompt, *received]
    assert index.match([*seen, 0]) == len(seen) // BS * BS >= 3 * BS
    assert len(cache.refs) == (len(prompt) + produced) // BS < (len(prompt) + 500) // BS
    # Filling the cache with other prompts evicts through BlockRemoved events: still in step.
    for i in range(12):
        filler = asyncio.create_task(_collect(engine.generate(Request(f"f{i}", [100 + i] * (3 * BS), opts(1))), []))
        await clock.run_until(filler.done)
    assert set(cache.refs) == {h for h, _ in index.iter_blocks()} and cache.evictions > 0


def test_a_kv_cache_smaller_than_one_request_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        SimEngine(block_size=BS, num_blocks=16, max_model_len=1024)


async def test_an_abort_while_waiting_never_runs() -> None:
    clock = ManualClock()
    profile = replace(fixed_step_profile(0.05), max_num_seqs=1)  # one request at a time
    engine, _ = await started(profile=profile, num_blocks=64, clock=clock)
    first = asyncio.create_task(_drain(engine.generate(Request("first", [7] * 40, opts(10)))))
    await settle()
    task = asyncio.create_task(_drain(engine.generate(Request("queued", [8] * 40, opts(10)))))
    await settle()
    assert engine.status().load.running == 1 and engine.status().load.waiting == 1
    task.cancel()
    await settle()
    assert task.cancelled()
    status = engine.status()
    assert status.load.waiting == 0 and status.unfinished == 1  # gone from the queue, before any step
    await clock.run_until(first.done)
    assert first.result() == 10
    assert engine.status().load.running == 0 and engine.status().load.waiting == 0
    assert engine._engine.steps == 10  # type: ignore[union-attr]  # first's ten tokens: the queued one never ran


async def test_an_arrival_during_a_decode_run_of_instant_steps_is_served() -> None:
    """A request that arrives while an instant-profile engine (every step takes 0 s: ``--engine sim``'s default)
    is decoding: ``submit`` cuts the run at the step in progress. The run of 0 s steps is over at the instant it
    started, so there is nothing to cut: the run's end admits the arrival. (The cut used to compute the step in
    progress as ``int(dt / alpha)`` with alpha, the step time, 0: the arrival's ``generate`` raised
    ZeroDivisionError, which a node answered with INTERNAL.)"""
    clock = ManualClock()
    engine, _ = await started(profile=fixed_step_profile(0.0), num_blocks=64, clock=clock)
    first = asyncio.create_task(_drain(engine.generate(Request("first", [7] * 40, opts(10)))))
    await settle()
    await clock.step()  # its prefill step: it decodes now, in a run of instant steps not ended yet
    assert engine._engine.state == 2  # type: ignore[union-attr]  # _RUN
    second = asyncio.create_task(_drain(engine.generate(Request("second", [8] * 40, opts(10)))))
    await clock.run_until(lambda: first.done() and second.done())
    assert await first == 10
    assert await second == 10


async def test_many_arrivals_in_the_first_instants_of_an_instant_engine_all_complete() -> None:
    """Start-up concurrency on the default ``--engine sim`` profile (instant steps): requests keep arriving while the
    first ones prefill and decode -- in the middle of steps and of decode runs -- and every one of them completes
    with all its tokens; the engine ends with nothing running, waiting or pinned."""
    clock = ManualClock()
    engine, index = await started(profile=fixed_step_profile(0.0), num_blocks=256, clock=clock)
    tasks = [
        asyncio.create_task(_drain(engine.generate(Request(f"a{i}", [9 + i % 5] * (20 + i), opts(8)))))
        for i in range(10)
    ]
    await settle()
    states = set()
    for wave in range(8):  # every other step boundary lets a few more in, as a burst of clients connecting does
        await clock.step()
        await clock.step()
        states.add(engine._engine.state)  # type: ignore[union-attr]
        tasks += [
            asyncio.create_task(_drain(engine.generate(Request(f"w{wave}.{i}", [40 + wave, i] * 30, opts(5 + i)))))
            for i in range(5)
        ]
        await settle()
    assert 2 in states  # some arrivals met a decode run in progress (what used to fail)
    await clock.run_until(lambda: all(t.done() for t in tasks))
    assert [t.exception() for t in tasks] == [None] * len(tasks)
    assert [t.result() for t in tasks] == [8] * 10 + [5 + i for _ in range(8) for i in range(5)]
    status = engine.status()
    assert status.unfinished == 0 and status.load.running == 0 and status.load.waiting == 0
    cache = engine._engine.cache  # type: ignore[union-attr]
    assert cache.n_pinned == 0 and set(cache.refs) == {h for h, _ in index.iter_blocks()}


async def _drain(stream: object) -> int:
    return sum([len(c.token_ids) async for c in stream])  # type: ignore[attr-defined]


async def _collect(stream: object, into: list) -> None:
    async for c in stream:  # type: ignore[attr-defined]
        into.append(c)


async def _collect_until(stream: object, into: list[int], tokens: int) -> None:
    """Read ``stream``'s tokens into ``into`` until it holds ``tokens`` of them (the stream stays open)."""
    async for chunk in stream:  # type: ignore[attr-defined]
        into += chunk.token_ids
        if len(into) >= tokens:
            return
