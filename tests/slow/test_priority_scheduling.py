"""A request's priority takes effect on a real engine: with room for one sequence (``--max-num-seqs 1``), a
high-priority request that arrives behind two queued low-priority ones runs first when the slot frees.

Before, a node ran vLLM's default first-come-first-served scheduling unless its engine ran p2pnode's KV connector
(pulls, a segment store, a tier): a GPU node without pulls (segments need the CPU layout), or this one with no segment
store, ran the high-priority request last. Across a forward the priority travels with the request (unit-tested:
tests/unit/test_http_surface.py), so every node that serves it orders it the same way."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import pytest

from p2pnode.client import GenerateResult, build_request, collect
from p2pnode.v1 import node_pb2, node_pb2_grpc
from tests.integration.conftest import LONG_ENGINE, MULTI_ENGINE_ENV, make_vllm_node
from tests.polling import until

pytestmark = pytest.mark.integration

#: No KV connector in the engine (no segment store, no pulls, no tier), as on a GPU node that moves no KV.
NO_CONNECTOR = ["--segment-store-mb", "0"]
#: Lower runs first, as vLLM orders priorities.
HIGH, LOW = -1, 0


async def test_a_high_priority_request_overtakes_queued_low_priority_ones(tiny_model: Path, tmp_path: Path) -> None:
    node = make_vllm_node(
        tiny_model, "n1", tmp_path, *LONG_ENGINE, *NO_CONNECTOR, "--max-num-seqs", "1", env=MULTI_ENGINE_ENV
    )
    node.start()
    try:
        async with grpc.aio.insecure_channel(node.address or "") as channel:
            stub = node_pb2_grpc.NodeStub(channel)
            finished: list[str] = []

            async def generate(name: str, prompt: str, priority: int, max_tokens: int = 8) -> GenerateResult:
                request = build_request(prompt, max_tokens=max_tokens, ignore_eos=True, request_id=name)
                request.sampling.priority = priority
                result = await collect(stub, request, timeout=120)
                finished.append(name)
                return result

            async def load() -> node_pb2.EngineLoad:
                return (await stub.GetStatus(node_pb2.GetStatusRequest(), timeout=10)).load

            # the one slot, held until the others are queued (then cancelled: the slot frees at once)
            holder = asyncio.create_task(generate("holder", "a long answer holds the only slot", LOW, 3000))
            await until(load, "the long request to run", holds=lambda lo: lo.running == 1)
            low = [
                asyncio.create_task(generate(f"low-{i}", f"a low priority question number {i}", LOW)) for i in range(2)
            ]
            await until(load, "two low-priority requests to queue", holds=lambda lo: lo.waiting == 2)
            high = asyncio.create_task(generate("high", "an urgent question for the engine", HIGH))
            await until(load, "the high-priority request to queue", holds=lambda lo: lo.waiting == 3)
            holder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await holder
            results = await asyncio.gather(high, *low)
            assert all(r.completion_tokens == 8 for r in results)
            assert finished[0] == "high" and sorted(finished[1:]) == ["low-0", "low-1"], finished
    finally:
        node.kill()
